"""Render the results report (docs/results.md) from the benchmarks' JSON files: `sao bench report`.

`sao bench all` calls this at its end, so the report is reproduced from scratch by one command.
Every number in the report is read from OUT_DIR/NAME.json (or, for a verdict, computed from it);
the only constants are the acceptance targets of the benchmarks (bench/report_systems.py TARGETS),
which are requirements, not measurements. A benchmark without a JSON file is reported as "not measured".
Notes about what a number means (simulated engines, quick runs, shared cores) are emitted only when
the JSON says so.

Quick (CI) runs, and any out dir other than the repository's results/, render OUT_DIR/results.md:
the repository's docs/results.md only ever shows the results/ files.

This module frames the report (preamble, the paper's claims with a verdict each, one section per
benchmark of bench/registry.py, provenance); the sections' bodies are in bench/report_claims.py,
bench/report_learning.py and bench/report_systems.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from bench import REPO
from bench.registry import BENCHMARKS, RUN_ORDER
from bench.report_claims import claims_section


def report_path(out_dir: Path, quick: bool) -> Path:
    """docs/results.md for full-size runs in the repository's results/; OUT_DIR/results.md otherwise."""
    if not quick and Path(out_dir).resolve() == (REPO / "results").resolve():
        return REPO / "docs" / "results.md"
    return Path(out_dir) / "results.md"


HAND_WRITTEN = "<!-- hand-written below: kept as it is by `sao bench report` -->"


def write_report(results_dir: Path, doc_path: Path) -> Path:
    """Render the report; a hand-written tail of the existing file (from the HAND_WRITTEN marker on,
    e.g. measurements no bench renders yet) is kept."""
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    old = doc_path.read_text() if doc_path.is_file() else ""
    tail = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""
    doc_path.write_text(render(Path(results_dir), doc_path) + ("\n" + tail if tail else ""))
    return doc_path


def load_results(results_dir: Path) -> dict[str, dict]:
    found = {}
    for name in RUN_ORDER:
        path = results_dir / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def render(results_dir: Path, doc_path: Path) -> str:
    results = load_results(results_dir)
    link = _linker(results_dir, doc_path)
    parts = [_preamble(results, results_dir, doc_path)]
    claims = claims_section(results)
    if claims:
        parts.append(claims)
    for bench in BENCHMARKS:
        parts.append(_section(bench.name, bench.title, results.get(bench.name), bench.section, link))
    return "\n\n".join(parts).rstrip() + "\n"


# ------------------------------------------------------------------------------------------- framing


def _linker(results_dir: Path, doc_path: Path) -> Callable[[str, str], str]:
    """Markdown image of results_dir/file relative to the report; '' when the file does not exist."""
    def link(file: str, alt: str) -> str:
        path = results_dir / file
        if not path.is_file():
            return ""
        return f"![{alt}]({os.path.relpath(path.resolve(), doc_path.resolve().parent)})"
    return link


def machine_text(m: Optional[dict]) -> str:
    if not m:
        return "machine not recorded"
    parts = [f"{m.get('cpus', '?')} CPU cores"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']:g} GiB")
    parts.append(m["accelerator"] if m.get("accelerator") else
                 ("no GPU" if "accelerator" in m else "accelerator not recorded"))
    parts.append(f"Python {m.get('python', '?')}")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if m.get("megatron_core"):
        parts.append(f"megatron-core {m['megatron_core']}")
    return ", ".join(parts) + f" ({m.get('platform', 'platform not recorded')})"


def _preamble(results: dict, results_dir: Path, doc_path: Path) -> str:
    machines = sorted({machine_text(r.get("machine")) for r in results.values()})
    where = os.path.relpath(results_dir.resolve(), doc_path.resolve().parent)
    lines = ["# Results", "",
             f"Rendered by `sao bench report` from `{where}/NAME.json` (`sao bench all` reruns every benchmark "
             "and then renders this file; `--quick` runs render into their out dir instead). Every number "
             "below is read from those files; each section names the command that produced it, the machine "
             "and the wall time the file records. `--full` selects the paper-scale variants where a benchmark "
             "has one; `--resume` reads back the training runs an interrupted invocation finished in the same "
             "out dir or, for the full designs, which span several sessions and machines, in the run archive "
             "`results/archive/` that the checkout keeps (bench/run_archive.py). Timings on a small CPU machine shared by trainer, engine and benchmark processes are "
             "noisy between runs; ratios are measured side by side in one run.", ""]
    lines += ["Machines recorded in these files:" if len(machines) > 1 else "Machine recorded in these files:"]
    lines += [f"- {m}" for m in machines] or ["- none (no results yet)"]
    total = sum(_wall_s(r) for r in results.values())
    if total:
        lines += ["", f"Benchmark time recorded in these files: {total / 60:.0f} min in all (`sao bench all` runs "
                      f"them one after another; training runs read back from the run archive count at the wall "
                      f"time recorded when they ran)."]
    return "\n".join(lines)


def _wall_s(result: dict) -> float:
    """Seconds a result took; a benchmark merged from per-task runs counts each task's run."""
    runs = [max(v.get("wall_s") or 0.0, (v.get("runs_wall_s") or 0.0) / (v.get("jobs") or 1))
            for v in (result.get("task_runs") or {}).values()]
    if runs:   # a task whose runs were read back from the archive counts their recorded time, jobs at a time
        return float(sum(runs))
    wall = result.get("wall_s")
    return float(wall) if isinstance(wall, (int, float)) else 0.0


def _section(name: str, title: str, result: Optional[dict], body, link) -> str:
    head = f"## {title} (`sao bench {name}`)"
    if result is None:
        return f"{head}\n\nNot measured: there is no `{name}.json` (run `sao bench {name}`)."
    variant = (" (quick smoke version)" if result.get("quick") else
               " (paper-scale version)" if result.get("full") else "")
    wall = result.get("wall_s")
    provenance = (f"Measured by `{result.get('command', 'command not recorded')}`{variant} on "
                  f"{machine_text(result.get('machine'))}; wall time "
                  + (f"{wall:.0f} s." if isinstance(wall, (int, float)) else "not recorded."))
    if result.get("commit"):
        provenance += f" Code: commit {result['commit']}."
    if result.get("note"):
        provenance += f" Note: {result['note']}."
    try:
        text = body(result, link).strip()
    except KeyError as err:   # one stale file must not stop the whole report: say what it lacks instead
        text = (f"Not rendered: `{name}.json` has no field {err} that this section reads now (the file predates "
                f"the section's current form); rerun `sao bench {name}`.")
    return "\n\n".join([head, provenance, text])
