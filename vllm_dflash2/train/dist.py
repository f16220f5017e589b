"""Data-parallel context for training: one process per device, torch's launcher sets it up.

``torchrun --nproc-per-node N -m vllm_dflash2.train ...`` exports RANK, WORLD_SIZE and
LOCAL_RANK; a plain ``python -m vllm_dflash2.train`` has none of them and runs as world 1
without any process group. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0 alone writes checkpoints, exports, summaries and logs."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (a no-op at world 1)."""
        if self.active:
            tdist.all_reduce(t)
        return t

    def from_main(self, values: list[float]) -> list[float]:
        """Rank 0's values on every rank (decisions taken from its clock: stop, schedule)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        tdist.broadcast(t, 0)
        return t.tolist()

    def check_same(self, t: torch.Tensor | None, name: str) -> None:
        """Refuse to train when ranks derived different values (they would train different models)."""
        if not self.active:
            return
        flat = torch.zeros(0) if t is None else t.detach().double().flatten().cpu()
        pos = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        s = torch.tensor([float(flat.sum()), float((flat * pos).sum()), -1.0 if t is None else flat.numel()],
                         dtype=torch.float64, device=self.device)
        lo, hi = s.clone(), s.clone()
        tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
        tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RuntimeError(f"{name} differs between ranks (checksum {lo.tolist()} .. {hi.tolist()}); "
                               "every rank must read the same data folders")


def init(timeout_min: float = 60.0) -> Dist:
    """The process's place in the job; initialises the process group under a launcher.

    The timeout covers rank 0's solo work (evaluation, exports) while the others wait.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not tdist.is_initialized():
        tdist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                 timeout=datetime.timedelta(minutes=timeout_min))
    return Dist(rank=rank, world=world, device=device)


def close(d: Dist) -> None:
    if d.active and tdist.is_initialized():
        tdist.destroy_process_group()
