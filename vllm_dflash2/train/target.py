"""The target as the pipeline loads it: the Hugging Face model (float32, eval mode, no
gradients) and its tokenizer, for training, the Hugging Face datagen engine and the
offline acceptance estimate. With no path, the default target (``vllm_dflash2.assets``)."""

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
