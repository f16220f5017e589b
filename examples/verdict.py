"""Judging greedy equality of speculative vs plain decoding, honestly, in any dtype.

Speculative decoding with greedy verification emits exactly the target's argmax tokens,
so in float32 the two runs agree token for token. In bfloat16 they may not: the target
verifies 1 + K rows per step instead of one, its GEMMs then run other kernels with
another accumulation order, and the logits move by a few bf16 steps. Where the target's
two best tokens are that close, the argmax can flip. That is a numerical near-tie, not a
bug; any other divergence is a bug.

Near-tie, precisely: at the first position where the two runs differ, the speculative
run's token is one of the plain run's top ``TOP_LOGITS`` and its logit is at most
``TIE_ULPS`` units in the last place (ulp) of the dtype below the plain run's top-1 logit,
at the larger logit's magnitude. Its rank does not matter: where three tokens lie within a
few ulps (seen: '\n', ' The' and the end-of-text token 0.125 and 0.375 apart in bf16),
any of them can come out on top. The ulp of x is 2 ** (floor(log2 |x|) - (p - 1)) for a
dtype of p significand bits (bfloat16 8, float16 11, float32 24): at |logit| in [16, 32) a
bf16 ulp is 0.125. The logits come from the plain engine itself
(``SamplingParams(logprobs=TOP_LOGITS)`` with ``logprobs_mode="raw_logits"``), at the
position where the outputs first differ (up to there both runs saw the same tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SIGNIFICAND_BITS = {"float32": 24, "bfloat16": 8, "float16": 11}
TIE_ULPS = 4  # a few ulps: the rounding of a few differently ordered bf16 GEMM outputs
TOP_LOGITS = 20  # the plain run's top logits read per position (vLLM's default cap)


def ulp(x: float, dtype: str) -> float:
    """Spacing of `dtype`'s representable numbers at |x| (normal range)."""
    if dtype not in SIGNIFICAND_BITS:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(SIGNIFICAND_BITS)}")
    m = abs(float(x))
    if not math.isfinite(m):
        raise ValueError(f"logit={x!r}: expected a finite number")
    if m == 0.0:
        m = 2.0 ** -126  # smallest normal of bf16 / float32: the finest spacing that matters
    exponent = math.frexp(m)[1] - 1  # m in [2**exponent, 2**(exponent + 1))
    return 2.0 ** (exponent - (SIGNIFICAND_BITS[dtype] - 1))


def tie_tolerance(top1: float, top2: float, dtype: str) -> float:
    """The largest top-1 / top-2 logit gap still judged a numerical near-tie."""
    return TIE_ULPS * ulp(max(abs(top1), abs(top2)), dtype)


def first_divergence(plain: list[int], spec: list[int]) -> int | None:
    """Index of the first differing token, or None if the sequences are equal."""
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            return i
    return None if len(plain) == len(spec) else min(len(plain), len(spec))


@dataclass
class Verdict:
    near_tie: bool
    reason: str
    gap: float | None = None  # plain top-1 logit minus the speculative token's logit
    tolerance: float | None = None


def judge(plain_token: int | None, spec_token: int | None, top: dict[int, float],
          dtype: str) -> Verdict:
    """Judge one divergence from the plain engine's top logits at that position.

    `top` maps token id -> raw logit for the plain run's top tokens (``TOP_LOGITS`` of them).
    """
    if plain_token is None or spec_token is None:
        return Verdict(False, "one output ended where the other went on (not a tie)")
    if plain_token not in top:
        return Verdict(False, f"plain token {plain_token} missing from its own top logits")
    if spec_token not in top:
        return Verdict(False, f"speculative token {spec_token} is not among the target's top "
                              f"{len(top)}")
    top1 = top[plain_token]
    other = top[spec_token]
    gap = top1 - other
    if gap < 0:
        return Verdict(False, "plain run did not take its own argmax", gap)
    tol = tie_tolerance(top1, other, dtype)
    if gap <= tol:
        return Verdict(True, f"near-tie: gap {gap:.4g} <= {TIE_ULPS} ulps of {dtype} "
                             f"({tol:.4g})", gap, tol)
    return Verdict(False, f"gap {gap:.4g} > {TIE_ULPS} ulps of {dtype} ({tol:.4g})", gap, tol)
