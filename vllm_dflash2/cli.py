"""`vllm-dflash2` command line: check, train, eval."""

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"check": _check}
    try:
        from .train.cli import main as train_main

        commands["train"] = train_main
    except ImportError:
        pass
    try:
        from .evaluate import main as eval_main

        commands["eval"] = eval_main
    except ImportError:
        pass
    if not argv or argv[0] not in commands:
        print(f"usage: vllm-dflash2 {{{','.join(commands)}}} [options]  (-h for help)")
        return 2
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
