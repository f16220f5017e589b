"""Pure-PyTorch reference ops for DFlash2.

These are the oracle for every test and the fallback wherever the native
extension is absent. The fast ops in ``vllm_dflash2.ops`` have the same
signatures and must agree with these (exactly for token ids in greedy mode).

Shapes (N = rows of a request-major batch of blocks, B = block size = 1 + K):
    x      [N, H]          activations, row r is block position r % B
    delta  [N, T, G]       dynamic taps per row and channel group
    base   [T, H]          static taps (one side of ``base_kernel``)
"""

from __future__ import annotations

import torch

# Multiplier that separates the per-step counters fed to the hash below.
_STEP_STRIDE = 0x9E3779B1
_MASK32 = 0xFFFFFFFF


def grouped_conv_ref(
    x: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """Two-or-more-tap dynamic grouped convolution inside each block.

    ``out[r, c] = sum_t 1[r % B >= t] * (base[t, c] + delta[r, t, c // gs]) * x[r - t, c]``

    Taps never cross a block start, so block position 0 only sees itself.
    Accumulates in float32 and returns ``x.dtype``.
    """
    n, h = x.shape
    taps = base.shape[0]
    xf = x.float()
    coef = base.float().view(1, taps, h) + delta.float().repeat_interleave(group_size, dim=-1)
    pos = torch.arange(n, device=x.device) % block_size
    out = coef[:, 0] * xf
    for t in range(1, taps):
        shifted = torch.zeros_like(xf)
        shifted[t:] = xf[:-t]
        out += (pos >= t).view(-1, 1) * coef[:, t] * shifted
    return out.to(x.dtype)


def grouped_conv_prepare_ref(
    x: torch.Tensor,
    projection: torch.Tensor,
    base0: torch.Tensor,
    block_size: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First side of a DFlash2 conv pair.

    ``projection`` is ``kernel_projection(x)``, ``[N, 2 * T * G]``. Returns the
    convolved input and the second-side coefficients ``[N, T, G]`` (float32).
    """
    taps = base0.shape[0]
    coef = projection.float().view(x.shape[0], 2, taps, -1)
    return grouped_conv_ref(x, coef[:, 0], base0, block_size, group_size), coef[:, 1].contiguous()


def grouped_conv_finish_ref(
    z: torch.Tensor,
    coef1: torch.Tensor,
    base1: torch.Tensor,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """Second side of a DFlash2 conv pair (after the sub-layer)."""
    return grouped_conv_ref(z, coef1, base1, block_size, group_size)


def score_edges_ref(
    candidate_ids: torch.Tensor,
    unary: torch.Tensor,
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
) -> torch.Tensor:
    """Edge scores of the low-rank candidate selector.

    candidate_ids [Bq, L, k] int64, unary [Bq, L, k], hidden [Bq, L, r]
    (already ``hidden_projection``-ed), anchor_ids [Bq], codebooks [V, r].
    Returns float32 ``[Bq, L, k(prev), k(cur)]``::

        score[b,l,p,c] = unary[b,l,c] + sum_r Pred[prev(b,l,p), r] * hidden[b,l,r] * Succ[cand[b,l,c], r]

    with ``prev(b,0,p) = anchor[b]`` and ``prev(b,l,p) = cand[b,l-1,p]``.
    """
    k = candidate_ids.shape[-1]
    prev_ids = torch.cat(
        (anchor_ids.view(-1, 1, 1).expand(-1, 1, k), candidate_ids[:, :-1]), dim=1
    )
    pred = predecessor_codebook[prev_ids].float()
    succ = successor_codebook[candidate_ids].float()
    pair = torch.einsum("blpr,blcr->blpc", pred * hidden.float().unsqueeze(2), succ)
    return unary.float().unsqueeze(2) + pair


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3 finalizer on uint32 values held in int64 (low 32 bits are exact).
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def counter_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Counter-based uniform in (0, 1) for each request and walk step.

    Depends only on (seed, step), never on the batch the request sits in.
    The native kernels implement the same hash bit for bit.
    """
    seeds = seeds.to(torch.int64)
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    h = _fmix32(lo ^ _fmix32(hi ^ _fmix32(torch.full_like(seeds, (step + 1) * _STEP_STRIDE))))
    # 24 random bits, centred in their bucket: never exactly 0 or 1.
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def proposal_probs_ref(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """K-way proposal distribution of one walk step for each request.

    scores [Bq, k] float32, temperature [Bq] (> 0), optional per-request
    top_k [Bq] int (0 = off) and top_p [Bq] float (1 = off), applied the way
    vLLM's sampler applies them to the target. Returns float32 [Bq, k].
    """
    probs = torch.softmax(scores.float() / temperature.float().view(-1, 1), dim=-1)
    if top_k is None and top_p is None:
        return probs
    k = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k is not None:
        kk = torch.where(top_k > 0, top_k, k).clamp(max=k).view(-1, 1)
        keep &= torch.arange(k, device=probs.device).view(1, -1) < kk
    if top_p is not None:
        # Keep the smallest prefix whose mass reaches top_p (always the first).
        before = sorted_p.cumsum(-1) - sorted_p
        keep &= before < top_p.float().view(-1, 1)
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def walk_ref(
    candidate_ids: torch.Tensor,
    scores: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk one path through the candidate lattice.

    candidate_ids [Bq, L, k], scores [Bq, L, k, k] (from ``score_edges_ref``),
    temperature [Bq] (<= 0 means greedy), seeds [Bq] int64.

    Greedy: ``c_l = argmax score[l, c_{l-1}, :]`` (first index on ties).
    Sampled: ``c_l`` is drawn by inverse CDF from the proposal of step l with
    ``counter_uniform(seed, l)``.

    Returns ``(tokens [Bq, L] int64, q [Bq, L, k] float32, choice [Bq, L] int64)``
    where ``q`` is the realized proposal each token was drawn from (one-hot
    for greedy requests): hand it to the rejection sampler for lossless sampling.
    """
    bq, length, k, _ = scores.shape
    device = scores.device
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    rows = torch.arange(bq, device=device)
    prev = torch.zeros(bq, dtype=torch.int64, device=device)  # all rows equal at l = 0
    tokens = torch.empty(bq, length, dtype=torch.int64, device=device)
    choice = torch.empty(bq, length, dtype=torch.int64, device=device)
    q = torch.empty(bq, length, k, dtype=torch.float32, device=device)
    for step in range(length):
        s = scores[rows, step, prev].float()  # [Bq, k]
        probs = proposal_probs_ref(s, safe_t, top_k, top_p)
        u = counter_uniform(seeds, step).to(device)
        cdf = probs.cumsum(-1)
        sampled = (cdf < u.view(-1, 1)).sum(-1).clamp(max=k - 1)
        # Never land on a zero-probability tail entry because of rounding.
        last_nonzero = (probs > 0).to(torch.int64).cumsum(-1).argmax(-1)
        sampled = torch.minimum(sampled, last_nonzero)
        best = s.argmax(-1)
        c = torch.where(greedy, best, sampled)
        one_hot = torch.nn.functional.one_hot(c, k).float()
        q[:, step] = torch.where(greedy.view(-1, 1), one_hot, probs)
        choice[:, step] = c
        tokens[:, step] = candidate_ids[rows, step, c]
        prev = c
    return tokens, q, choice


def select_candidates_ref(
    candidate_ids: torch.Tensor,
    unary: torch.Tensor,
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Edge scoring + walk in one call: ``(tokens [Bq, L], q [Bq, L, k])``."""
    scores = score_edges_ref(
        candidate_ids, unary, hidden, anchor_ids, predecessor_codebook, successor_codebook
    )
    tokens, q, _ = walk_ref(candidate_ids, scores, temperature, seeds, top_k, top_p)
    return tokens, q


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, float32 math, result in ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


# Packed linear (the CPU target GEMM): float32 weight [N, K] <-> packed [N / 8, K, 8];
# bfloat16 weight [N, K] <-> packed [N / 16, K / 2, 32] (pairs of K, as VDPBF16PS reads them).
PACKED_COLS = 8
PACKED_COLS_BF16 = 16


def pack_linear_weight_ref(weight: torch.Tensor) -> torch.Tensor:
    """float32: columns in blocks of 8, K-major inside a block: ``packed[j, k, c] =
    weight[8 j + c, k]``. bfloat16: blocks of 16 columns, pairs of K inside:
    ``packed[j, p, 2 c + i] = weight[16 j + c, 2 p + i]``."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        if n % PACKED_COLS_BF16 or k % 2:
            raise ValueError(f"a bfloat16 weight.size(0)={n} must be a multiple of "
                             f"{PACKED_COLS_BF16} and weight.size(1)={k} even")
        return (weight.reshape(n // PACKED_COLS_BF16, PACKED_COLS_BF16, k // 2, 2)
                .permute(0, 2, 1, 3).reshape(n // PACKED_COLS_BF16, k // 2, 2 * PACKED_COLS_BF16))
    if n % PACKED_COLS:
        raise ValueError(f"weight.size(0)={n} must be a multiple of {PACKED_COLS}")
    return weight.reshape(n // PACKED_COLS, PACKED_COLS, k).transpose(1, 2).contiguous()


def unpack_linear_weight_ref(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype == torch.bfloat16:
        blocks, pairs, _ = packed.shape
        return (packed.reshape(blocks, pairs, PACKED_COLS_BF16, 2).permute(0, 2, 1, 3)
                .reshape(blocks * PACKED_COLS_BF16, 2 * pairs))
    blocks, k, cols = packed.shape
    return packed.transpose(1, 2).reshape(blocks * cols, k)


def packed_linear_ref(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the weight given packed; bfloat16 sums in float32 and
    rounds once, as the native kernel."""
    weight = unpack_linear_weight_ref(packed)
    if packed.dtype == torch.bfloat16:
        return torch.nn.functional.linear(
            x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)
