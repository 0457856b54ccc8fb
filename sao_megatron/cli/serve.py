"""`sao serve`: run the reference rollout server (SGLang HTTP protocol, HF transformers on CPU).

    sao serve --model DIR --host 127.0.0.1 --port 30000 --api-key KEY [--max-batch 64]

Flags are those of `python -m rollout.reference_server` (rollout/reference_server/server.py).
"""
from __future__ import annotations

import sys


def register(sub) -> None:
    from rollout.reference_server.server import add_arguments

    parser = sub.add_parser("serve", help="Run the reference rollout server (SGLang HTTP protocol, CPU)")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from rollout.reference_server.server import options_from_args, serve

    try:
        serve(options_from_args(args))
    except ValueError as err:
        print(f"sao serve: {err}", file=sys.stderr)
        return 2
    return 0
