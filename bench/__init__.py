"""Benchmarks: `sao bench NAME` runs bench/NAME.py, writes OUT_DIR/NAME.json and renders the report.

bench/registry.py lists them; bench/runner.py runs one; bench/report.py renders docs/results.md.
Nothing here imports the CLI (sao_megatron/cli/bench.py imports this package, never the reverse).
"""
from pathlib import Path

# The checkout this package runs from: its recipes/, results/ and docs/results.md.
REPO = Path(__file__).resolve().parents[1]
