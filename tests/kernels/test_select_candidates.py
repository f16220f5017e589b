"""Native fused candidate selection (edge scores + walk + q) vs ops/reference.py."""

import pytest
import torch
from torch.library import opcheck

from vllm_dflash2 import ops
from vllm_dflash2.ops import reference as ref

from .utils import DEVICES, DTYPES, assert_close, non_contiguous_rows

native_select = torch.ops.vllm_dflash2.select_candidates.default


def make_inputs(bq, length, k, rank, vocab, cb_dtype, device, act_dtype=torch.float32, seed=0,
                greedy_frac=0.5):
    gen = torch.Generator().manual_seed(seed)
    # Distinct candidates per step, as top-k produces.
    cand = torch.rand(bq, length, vocab, generator=gen).argsort(-1)[..., :k].contiguous()
    unary = (2.0 * torch.randn(bq, length, k, generator=gen)).to(act_dtype)
    hidden = torch.randn(bq, length, rank, generator=gen).to(act_dtype)
    anchor = torch.randint(0, vocab, (bq,), generator=gen)
    scale = rank ** -0.25
    pred = (scale * torch.randn(vocab, rank, generator=gen)).to(cb_dtype)
    succ = (scale * torch.randn(vocab, rank, generator=gen)).to(cb_dtype)
    temp = 0.3 + 1.5 * torch.rand(bq, generator=gen)
    temp[torch.rand(bq, generator=gen) < greedy_frac] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (bq,), generator=gen)
    return [t.to(device) for t in (cand, unary, hidden, anchor, pred, succ, temp, seeds)]


def filters(bq, k, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    top_k = torch.randint(0, k + 2, (bq,), generator=gen)  # 0 = off, > k clamps
    top_p = torch.where(torch.rand(bq, generator=gen) < 0.3, torch.ones(bq),
                        0.2 + 0.8 * torch.rand(bq, generator=gen))
    return top_k.to(device), top_p.to(device)


@pytest.mark.parametrize("cb_dtype", DTYPES)
def test_opcheck_cpu(cb_dtype):
    args = make_inputs(5, 7, 16, 32, 300, cb_dtype, "cpu")
    top_k, top_p = filters(5, 16, "cpu")
    opcheck(native_select, (*args, None, None))
    opcheck(native_select, (*args, top_k, top_p))
    opcheck(native_select, (*args, None, top_p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cb_dtype", DTYPES)
@pytest.mark.parametrize("bq, length, k, rank", [
    (1, 7, 16, 64), (8, 7, 16, 64), (3, 1, 1, 1), (13, 5, 4, 31), (64, 7, 16, 256),
    (256, 7, 16, 64), (9, 15, 64, 512), (17, 3, 33, 100),
])
def test_greedy_matches_reference_exactly(device, cb_dtype, bq, length, k, rank):
    args = make_inputs(bq, length, k, rank, 2 * 64 + 997, cb_dtype, device, greedy_frac=1.0)
    tokens, q = ops.select_candidates(*args)
    tokens_ref, q_ref = ref.select_candidates_ref(*args)
    assert tokens.dtype == torch.int64 and q.dtype == torch.float32
    assert torch.equal(tokens, tokens_ref)
    assert torch.equal(q, q_ref)  # one-hot


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cb_dtype", DTYPES)
@pytest.mark.parametrize("use_filters", [False, True])
@pytest.mark.parametrize("bq, k, rank", [(64, 16, 64), (256, 16, 32), (31, 64, 128)])
def test_sampled_matches_reference(device, cb_dtype, use_filters, bq, k, rank):
    args = make_inputs(bq, 7, k, rank, 5000, cb_dtype, device, greedy_frac=0.25, seed=bq + k)
    extra = filters(bq, k, device) if use_filters else (None, None)
    tokens, q = ops.select_candidates(*args, *extra)
    tokens_ref, q_ref = ref.select_candidates_ref(*args, *extra)
    agree = (tokens == tokens_ref).float().mean().item()
    print(f"agreement {agree:.4f}")
    assert agree >= 0.99
    # q is compared where both walks took the same path (q depends on the path).
    same_path = (tokens == tokens_ref).cumprod(dim=1).bool()
    assert_close(q[same_path], q_ref[same_path], torch.float32)
    torch.testing.assert_close(q.sum(-1), torch.ones_like(q[..., 0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_activation_dtypes_and_non_contiguous(device):
    bq, length, k, rank = 19, 7, 16, 64
    cand, unary, hidden, anchor, pred, succ, temp, seeds = make_inputs(
        bq, length, k, rank, 800, torch.bfloat16, device, act_dtype=torch.bfloat16, seed=4)
    want = ref.select_candidates_ref(cand, unary.float(), hidden, anchor, pred.float(), succ,
                                     temp, seeds)
    got = ops.select_candidates(
        non_contiguous_rows(cand), non_contiguous_rows(unary.float()), non_contiguous_rows(hidden),
        anchor.to(torch.int32), non_contiguous_rows(pred.float()), non_contiguous_rows(succ),
        temp.double(), seeds)
    assert (got[0] == want[0]).float().mean().item() >= 0.99
    greedy = temp <= 0
    assert torch.equal(got[0][greedy], want[0][greedy])


@pytest.mark.parametrize("device", DEVICES)
def test_walk_depends_only_on_seed(device):
    """A request's walk is the same whatever batch it sits in (counter RNG on (seed, step))."""
    args = make_inputs(40, 7, 16, 64, 600, torch.float32, device, greedy_frac=0.0, seed=5)
    tokens, q = ops.select_candidates(*args)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(device)
    tokens_p, q_p = ops.select_candidates(*(t[perm] if t.shape[0] == 40 else t for t in args))
    assert torch.equal(tokens_p, tokens[perm])
    assert torch.equal(q_p, q[perm])


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_match_q(device):
    """Empirical choice frequencies of steps 0 and 1 over many seeds match q.

    One request repeated n times with distinct seeds. Step 0: chi-square
    goodness of fit against q[:, 0] (p > 1e-4). Step 1: total variation between
    the frequency of the chosen index and the mean of q[:, 1] over the walks
    (E[1{c1 = j}] = E[q1(c0)[j]]) below 0.02 (about 5 sigma at n = 20000, k = 8).
    """
    from scipy.stats import chisquare

    n, k, rank = 20000, 8, 16
    one = make_inputs(1, 2, k, rank, 100, torch.float32, "cpu", greedy_frac=0.0, seed=6)
    cand, unary, hidden, anchor, pred, succ, temp, _ = one
    temp = torch.tensor([1.3])
    batch = [t.expand(n, *t.shape[1:]).contiguous() for t in (cand, unary, hidden, anchor)]
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 12345
    args = [*batch, pred, succ, temp.expand(n).contiguous(), seeds]
    tokens, q = ops.select_candidates(*(t.to(device) for t in args))
    tokens, q = tokens.cpu(), q.cpu()
    index = (cand[0].unsqueeze(0) == tokens.unsqueeze(-1)).int().argmax(-1)  # [n, 2]
    freq0 = torch.bincount(index[:, 0], minlength=k).double()
    expected0 = q[0, 0].double() * n
    assert torch.allclose(q[:, 0], q[:1, 0].expand(n, k))
    _, p_value = chisquare(freq0.numpy(), expected0.numpy() * freq0.sum().item() / expected0.sum().item())
    print(f"step 0 chi-square p = {p_value:.3g}")
    assert p_value > 1e-4
    freq1 = torch.bincount(index[:, 1], minlength=k).double() / n
    tv = 0.5 * (freq1 - q[:, 1].double().mean(0)).abs().sum().item()
    print(f"step 1 TV = {tv:.4f}")
    assert tv < 0.02


@pytest.mark.parametrize("device", DEVICES)
def test_filters_zero_the_tail(device):
    bq, k = 50, 16
    args = make_inputs(bq, 7, k, 32, 400, torch.float32, device, greedy_frac=0.0, seed=7)
    top_k = torch.full((bq,), 3, device=device)
    tokens, q = ops.select_candidates(*args, top_k, None)
    assert ((q > 0).sum(-1) <= 3).all()
    assert (q[q > 0] > 0).all()
    cand = args[0]
    chosen = (cand == tokens.unsqueeze(-1)).int().argmax(-1)
    assert (q.gather(-1, chosen.unsqueeze(-1)) > 0).all()  # never samples a zeroed entry


def test_rejects_bad_inputs_with_named_argument():
    args = make_inputs(4, 7, 16, 32, 100, torch.float32, "cpu")
    cand, unary, hidden, anchor, pred, succ, temp, seeds = args
    with pytest.raises(RuntimeError, match="outside"):
        native_select(cand + 100, unary, hidden, anchor, pred, succ, temp, seeds)
    with pytest.raises(RuntimeError, match="hidden must be"):
        native_select(cand, unary, hidden[:2], anchor, pred, succ, temp, seeds)
    with pytest.raises(RuntimeError, match="top-k"):
        native_select(cand.repeat(1, 1, 5), unary.repeat(1, 1, 5), hidden, anchor, pred, succ,
                      temp, seeds)
    with pytest.raises(RuntimeError, match="successor_codebook must be"):
        native_select(cand, unary, hidden, anchor, pred, succ[:, :8], temp, seeds)
    with pytest.raises(RuntimeError, match="top_k must be"):
        native_select(cand, unary, hidden, anchor, pred, succ, temp, seeds, temp[:1].long(), None)


def test_empty_batch_and_compile():
    args = make_inputs(0, 7, 16, 32, 100, torch.float32, "cpu")
    tokens, q = ops.select_candidates(*args)
    assert tokens.shape == (0, 7) and q.shape == (0, 7, 16)
    args = make_inputs(6, 7, 16, 32, 100, torch.float32, "cpu")
    compiled = torch.compile(ops.select_candidates, backend="aot_eager", fullgraph=True)
    got, want = compiled(*args), ops.select_candidates(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
