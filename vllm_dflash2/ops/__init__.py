"""DFlash2 ops: the fastest available implementation of each.

Public API (same signatures as the ``reference`` twins):
    grouped_conv_prepare, grouped_conv_finish, select_candidates
The native extension (``vllm_dflash2._C``) is used when it is importable for
the tensor's device; otherwise the pure-PyTorch reference runs, with one warning.
"""

from .reference import (
    grouped_conv_finish_ref as grouped_conv_finish,
    grouped_conv_prepare_ref as grouped_conv_prepare,
    select_candidates_ref as select_candidates,
)

__all__ = ["grouped_conv_prepare", "grouped_conv_finish", "select_candidates"]
