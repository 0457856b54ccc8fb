"""`sao serve`: run the reference rollout server (SGLang HTTP protocol, HF transformers on CPU).

    SAO_API_KEY=KEY sao serve --model DIR --host 127.0.0.1 --port 30000 [--max-batch 64]

The key travels in $SAO_API_KEY (``--api-key`` works too, but `ps` shows a command line to every
user); without one the weight and control routes answer 403 unless ``--insecure``. Flags are those
of `python -m rollout.reference_server` (rollout/reference_server/server.py). Exit codes: 0 after
SIGTERM/SIGINT, 2 for a bad flag (one line, before the model loads), 1 when the server fails
(scheduler error, failed warmup): one line naming the cause.
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
