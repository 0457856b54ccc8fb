"""Subcommands whose feature is still being built say so and exit non-zero; none pretends to work."""
from __future__ import annotations

import sys


def register_pending(sub, name: str, help_text: str, issue: int) -> None:
    parser = sub.add_parser(name.replace("_", "-"), help=f"{help_text} [not built yet: issue #{issue}]")
    parser.add_argument("rest", nargs="*", help="ignored until the subcommand exists")

    def run(args) -> int:
        print(f"sao {name.replace('_', '-')}: not implemented yet (tracked in issue #{issue}).", file=sys.stderr)
        return 3

    parser.set_defaults(func=run)
