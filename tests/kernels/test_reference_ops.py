"""Reference ops vs naive per-element loops (the oracle of the oracle)."""

import math

import pytest
import torch

from vllm_dflash2.ops import reference as ref


def naive_conv(x, delta, base, block, gs):
    n, h = x.shape
    out = torch.zeros(n, h, dtype=torch.float64)
    for r in range(n):
        for c in range(h):
            for t in range(base.shape[0]):
                if r % block >= t:
                    out[r, c] += (base[t, c] + delta[r, t, c // gs]).double() * x[r - t, c].double()
    return out


@pytest.mark.parametrize("block,n,h,gs,taps", [(8, 16, 32, 16, 2), (3, 7, 12, 4, 2), (5, 11, 6, 3, 3), (2, 1, 4, 4, 2)])
def test_grouped_conv_matches_loops(block, n, h, gs, taps):
    g = torch.Generator().manual_seed(n * h)
    x = torch.randn(n, h, generator=g)
    delta = torch.randn(n, taps, h // gs, generator=g)
    base = torch.randn(taps, h, generator=g)
    got = ref.grouped_conv_ref(x, delta, base, block, gs)
    torch.testing.assert_close(got.double(), naive_conv(x, delta, base, block, gs), rtol=1e-5, atol=1e-5)


def test_conv_prepare_finish_split_projection():
    g = torch.Generator().manual_seed(1)
    n, h, gs, taps, block = 16, 8, 4, 2, 8
    x = torch.randn(n, h, generator=g)
    proj = torch.randn(n, 2 * taps * (h // gs), generator=g)
    base = torch.randn(2, taps, h, generator=g)
    y, coef1 = ref.grouped_conv_prepare_ref(x, proj, base[0], block, gs)
    coef = proj.view(n, 2, taps, h // gs)
    torch.testing.assert_close(y.double(), naive_conv(x, coef[:, 0], base[0], block, gs), rtol=1e-5, atol=1e-5)
    z = torch.randn(n, h, generator=g)
    out = ref.grouped_conv_finish_ref(z, coef1, base[1], block, gs)
    torch.testing.assert_close(out.double(), naive_conv(z, coef[:, 1], base[1], block, gs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bq,length,k,vocab,rank", [(3, 7, 4, 50, 6), (1, 1, 1, 5, 1), (2, 5, 16, 97, 3)])
def test_score_edges_matches_loops(bq, length, k, vocab, rank):
    g = torch.Generator().manual_seed(7)
    cand = torch.randint(0, vocab, (bq, length, k), generator=g)
    unary = torch.randn(bq, length, k, generator=g)
    hidden = torch.randn(bq, length, rank, generator=g)
    anchor = torch.randint(0, vocab, (bq,), generator=g)
    pred, succ = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
    got = ref.score_edges_ref(cand, unary, hidden, anchor, pred, succ)
    for b in range(bq):
        for l in range(length):
            for p in range(k):
                prev = anchor[b] if l == 0 else cand[b, l - 1, p]
                for c in range(k):
                    want = unary[b, l, c] + sum(
                        pred[prev, r] * hidden[b, l, r] * succ[cand[b, l, c], r] for r in range(rank)
                    )
                    assert math.isclose(got[b, l, p, c].item(), want.item(), rel_tol=1e-4, abs_tol=1e-4)


def test_greedy_walk_follows_argmax_chain():
    g = torch.Generator().manual_seed(3)
    bq, length, k = 4, 7, 5
    cand = torch.randint(0, 100, (bq, length, k), generator=g)
    scores = torch.randn(bq, length, k, k, generator=g)
    tokens, q, choice = ref.walk_ref(cand, scores, torch.zeros(bq), torch.arange(bq))
    for b in range(bq):
        prev = 0
        for l in range(length):
            c = max(range(k), key=lambda j: (scores[b, l, prev, j].item(), -j))
            assert choice[b, l].item() == c and tokens[b, l].item() == cand[b, l, c].item()
            assert q[b, l, c].item() == 1.0 and q[b, l].sum().item() == 1.0
            prev = c


def test_sampled_walk_reports_the_distribution_it_samples():
    g = torch.Generator().manual_seed(5)
    k, draws = 4, 20000
    cand = torch.arange(k).view(1, 1, k).expand(draws, 1, k)
    scores = torch.randn(1, 1, k, k, generator=g).expand(draws, 1, k, k)
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 + 11
    _, q, choice = ref.walk_ref(cand, scores, torch.full((draws,), 0.8), seeds)
    freq = torch.bincount(choice[:, 0], minlength=k).double() / draws
    # 4-sigma binomial band around q for every candidate.
    sigma = (q[0, 0].double() * (1 - q[0, 0].double()) / draws).sqrt()
    assert torch.all((freq - q[0, 0].double()).abs() <= 4 * sigma + 1e-9), (freq, q[0, 0])


def test_counter_uniform_is_batch_independent():
    seeds = torch.tensor([5, 9, -3, 2**40], dtype=torch.int64)
    whole = ref.counter_uniform(seeds, 3)
    parts = torch.cat([ref.counter_uniform(seeds[i : i + 1], 3) for i in range(4)])
    assert torch.equal(whole, parts)
    assert torch.all((whole > 0) & (whole < 1))
    assert not torch.equal(ref.counter_uniform(seeds, 3), ref.counter_uniform(seeds, 4))


def test_proposal_top_k_top_p_match_definition():
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    t = torch.ones(3)
    p = torch.softmax(scores[0], -1)
    got = ref.proposal_probs_ref(scores, t, torch.tensor([2, 0, 4]), torch.tensor([1.0, 0.7, 1.0]))
    torch.testing.assert_close(got[0], torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    # top_p 0.7: p = [.64, .24, .09, .03]; smallest prefix reaching 0.7 is two tokens.
    torch.testing.assert_close(got[1], torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    torch.testing.assert_close(got[2], p)
