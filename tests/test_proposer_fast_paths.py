"""DFlash2Proposer's shortcuts around upstream's per-step spec-decode work: each must give
exactly what upstream's own method gives on the same inputs."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.utils import CpuGpuBuffer

from vllm_dflash2.proposer import DFlash2Proposer

VOCAB = 100


@pytest.fixture(scope="module", autouse=True)
def _cpu_kernels():
    """Upstream's method launches a Triton kernel; on the CPU backend the worker swaps in
    vLLM's C++ twin at start-up, so do the same here."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def _proposer(max_batch: int = 16) -> DFlash2Proposer:
    """Only the state prepare_next_token_ids_padded reads."""
    p = DFlash2Proposer.__new__(DFlash2Proposer)
    p.backup_next_token_ids = CpuGpuBuffer(max_batch, dtype=torch.int32, device="cpu",
                                           pin_memory=False)
    return p


class _Request:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def get_token_id(self, idx: int) -> int:
        return self.tokens[idx]


def _batch(n: int, seed: int):
    g = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(n)]
    lengths = g.integers(3, 20, n)
    requests = {rid: _Request(g.integers(0, VOCAB, int(L)).tolist()) for rid, L in zip(ids, lengths)}
    batch = SimpleNamespace(num_reqs=n, req_ids=ids, vocab_size=VOCAB,
                            num_tokens_no_spec=(lengths - g.integers(0, 2, n)).astype(np.int32))
    return requests, batch


@pytest.mark.parametrize("case", ["one_sample", "discarded", "out_of_vocab", "rejected",
                                  "drafts_verified"])
@pytest.mark.parametrize("n", [1, 8])
def test_next_token_ids_equal_upstream(case, n):
    requests, batch = _batch(n, seed=n)
    g = torch.Generator().manual_seed(n)
    width = 4 if case == "drafts_verified" else 1
    sampled = torch.randint(0, VOCAB, (n, width), generator=g, dtype=torch.int32)
    discard = torch.zeros(16, dtype=torch.bool)
    if case == "discarded":
        discard[n - 1] = True
    if case == "out_of_vocab":
        sampled[0, 0] = VOCAB + 3
    if case == "rejected":
        sampled[n - 1, 0] = -1
    if case == "drafts_verified":
        sampled[0, 2:] = -1

    ours = DFlash2Proposer.prepare_next_token_ids_padded(_proposer(), sampled, requests, batch,
                                                         discard)
    upstream = DFlashProposer.prepare_next_token_ids_padded(_proposer(), sampled, requests,
                                                            batch, discard)
    for a, b in zip(ours, upstream):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (case, a, b)
    if case == "one_sample":  # the shortcut's own result, not the same object as the input
        assert ours[0].data_ptr() != sampled.data_ptr()
