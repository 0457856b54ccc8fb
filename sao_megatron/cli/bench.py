"""`sao bench NAME [--quick]`: run a benchmark from bench/, write results/NAME.json, print its summary.

Each bench/NAME.py exposes ``run(quick: bool) -> dict``; the dict's "summary" (a string) is printed and
everything is written as JSON. Numbers are measured side by side in one run and reported as measured.
"""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
import time
from pathlib import Path

BENCHES = ["engine", "pipeline", "weight_sync", "parallel", "algorithms", "stability", "online"]


def register(sub) -> None:
    parser = sub.add_parser("bench", help="Run benchmarks and write results/NAME.json")
    parser.add_argument("name", choices=BENCHES + ["all"], help="benchmark to run, or all")
    parser.add_argument("--quick", action="store_true", help="a small version for CI (well under a minute each)")
    parser.add_argument("--full", action="store_true",
                        help="the paper-scale version where a benchmark has one (hours on 2 CPU cores)")
    parser.add_argument("--out-dir", default="results", help="where NAME.json (and NAME.png) go")
    parser.set_defaults(func=run)


def machine() -> dict:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def run_one(name: str, quick: bool, out_dir: Path, full: bool = False) -> dict:
    module = importlib.import_module(f"bench.{name.replace('-', '_')}")
    started = time.perf_counter()
    kwargs = {"quick": quick}
    params = inspect.signature(module.run).parameters
    if "out_dir" in params:
        kwargs["out_dir"] = out_dir  # benchmarks that draw a PNG put it beside the JSON
    if full and "full" in params:
        kwargs["full"] = True
    result = module.run(**kwargs)
    result.setdefault("bench", name)
    result["quick"] = quick
    result["full"] = full and "full" in params
    result["machine"] = machine()
    result["wall_s"] = time.perf_counter() - started
    result["command"] = f"sao bench {name}" + (" --quick" if quick else "") + (" --full" if result["full"] else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
    return result


def run(args) -> int:
    out_dir = Path(args.out_dir)
    names = BENCHES if args.name == "all" else [args.name]
    failed = []
    for name in names:
        try:
            result = run_one(name, args.quick, out_dir, full=args.full)
        except Exception as err:  # one failed benchmark must not hide the others' results
            failed.append(name)
            print(f"bench {name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        print(f"== {name} ==\n{result.get('summary', '')}")
    return 1 if failed else 0
