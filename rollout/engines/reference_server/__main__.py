"""`python -m rollout.engines.reference_server --model DIR ...`: what `launch_local` spawns."""
from __future__ import annotations

import argparse
import sys

from .server import add_arguments, options_from_args, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.engines.reference_server",
                                     description="Reference rollout server (SGLang HTTP protocol, CPU).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        serve(options_from_args(args))
    except ValueError as err:
        print(f"reference server: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
