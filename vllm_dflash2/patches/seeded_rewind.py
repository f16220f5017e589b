"""The patch body of the CPU model runner: rewind the discarded sample of a seeded
request by saved generator state (CPU generators have no offset to rewind)."""

from __future__ import annotations

from types import ModuleType

from .common import replace_once


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# How many discarded samples of seeded requests the CPU rewind undid in this process
# (tests read it through collective_rpc: the split prefill really happened).
# Read as ``seeded_rewind.SEEDED_REWINDS``, never copied.
SEEDED_REWINDS = 0


def _discarded_cpu_generators(runner) -> dict | None:
    """Generator state of every seeded request whose sample this step will discard (a
    partial prefill), for the CPU generators that have no offset to rewind; None if none."""
    batch = runner.input_batch
    generators = batch.generators
    if not generators:
        return None  # unseeded traffic: one dict lookup per step
    discard = runner.discard_request_mask.np[: batch.num_reqs]
    saved = {}
    for i in discard.nonzero()[0].tolist():
        gen = generators.get(i)
        if gen is not None and gen.device.type == "cpu":
            saved[i] = (gen, gen.get_state())
    return saved or None


def rewind_discarded_seeded_samples(mod: ModuleType) -> None:
    if not _on_cpu_platform():
        return  # CUDA/XPU generators have the offset upstream rewinds

    def make_sample(original):
        def _sample(self, logits, spec_decode_metadata):
            # Before anything draws from the generators this step (bonus sample,
            # rejection sampling); restored in _bookkeeping_sync, after the drafter ran.
            self._dflash2_discarded_generators = _discarded_cpu_generators(self)
            return original(self, logits, spec_decode_metadata)

        return _sample

    def make_bookkeeping(original):
        def _bookkeeping_sync(self, *args, **kwargs):
            saved = self.__dict__.pop("_dflash2_discarded_generators", None)
            if not saved:
                return original(self, *args, **kwargs)
            global SEEDED_REWINDS
            batch = self.input_batch
            generators = batch.generators
            for gen, state in saved.values():
                gen.set_state(state)  # as if the discarded token had never been sampled
            SEEDED_REWINDS += len(saved)
            # Upstream's offset rewind must not see them (it raises on a CPU generator);
            # the dict itself (shared with the sampling metadata) stays as it is.
            batch.generators = {i: g for i, g in generators.items() if i not in saved}
            try:
                return original(self, *args, **kwargs)
            finally:
                batch.generators = generators

        return _bookkeeping_sync

    replace_once(mod.GPUModelRunner, "_sample", make_sample)
    replace_once(mod.GPUModelRunner, "_bookkeeping_sync", make_bookkeeping)
