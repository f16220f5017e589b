"""The target as the pipeline sees it: the Hugging Face model (float32, eval mode, no
gradients) and its tokenizer, for training and the offline acceptance estimate (with no
path, the default target of ``vllm_dflash2.assets``), and the layers whose raw outputs
the drafter reads (``default_layer_ids``, captured by ``TappedLayers``)."""

from __future__ import annotations

import torch


def load_target(path: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from ..assets import ensure_target

        path = str(ensure_target())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tok, path


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """The target layers tapped unless told otherwise: ``n`` spread from layer 1 to the
    second-to-last (datagen captures them, training reads them)."""
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)})


class TappedLayers:
    """Capture the raw outputs of the target's decoder layers ``layer_ids``.

    These are what vLLM hands a DFlash drafter: aux hidden state ``j + 1`` is
    ``hidden_states + residual`` after layer j, before any final norm. HF's
    ``output_hidden_states`` is not: its last entry is the output of the final norm,
    so a drafter tapping the last layer would train on features vLLM never gives it.

        with TappedLayers(target, layer_ids) as taps:
            target(...)
            feats = taps.features()  # [b, S, A*H], of the last call
    """

    def __init__(self, target, layer_ids: list[int]) -> None:
        self.layers = target.model.layers
        self.layer_ids = list(layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def __enter__(self):
        for j in self.layer_ids:
            def hook(_mod, _inp, out, j=j):
                self._out[j] = out[0] if isinstance(out, tuple) else out
            self._hooks.append(self.layers[j].register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def features(self) -> torch.Tensor:
        return torch.cat([self._out[j] for j in self.layer_ids], dim=-1)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated raw outputs of ``layer_ids`` (vLLM's aux hidden states): [b, S, A*H]."""
    with TappedLayers(target, layer_ids) as taps:
        target.model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        return taps.features()
