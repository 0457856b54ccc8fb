"""`sao`: one command, one module per subcommand (sao_megatron/cli/<name>.py).

Each module defines ``register(subparsers)`` (adds its parser, sets ``func=run``) and
``run(args) -> int``. A recipe error prints one line and exits with code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from sao_megatron.core.config import ConfigError

SUBCOMMANDS = ["train", "sft", "serve", "launch", "convert", "export", "plan", "doctor", "bench", "eval", "init_model"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sao", description="Asynchronous single-rollout RL for Megatron-Core MoE models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"sao_megatron.cli.{name}").register(sub)
    return parser


def _is_override(token: str) -> bool:
    key = token[2:] if token.startswith("--") else token
    return "=" in key and not key.startswith("-") and "." in key.split("=", 1)[0]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; dotted overrides may come before or after the options
    (`sao eval R.toml --checkpoint D eval.k=16` and `sao eval R.toml eval.k=16 --checkpoint D`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all(_is_override(t) for t in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"sao {args.command}: recipe error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sao {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
