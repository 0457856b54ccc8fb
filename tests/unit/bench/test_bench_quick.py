"""Every benchmark's quick mode runs and writes a well-formed results/NAME.json and a results report
that names every benchmark (numbers are never asserted as timings: only that they exist and are
finite where they must be)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.registry import RUN_ORDER as BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_quick_benchmark_writes_results(name, tmp_path):
    # run from a directory outside the repository with a relative out dir: `sao bench` works from anywhere
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "bench", name, "--quick",
                           "--out-dir", "out"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = (tmp_path / "out").resolve()
    result = json.loads((out / f"{name}.json").read_text())
    assert result["bench"] == name and result["quick"] is True
    assert result["command"] == f"sao bench {name} --quick"
    assert result["machine"]["cpus"] >= 1 and math.isfinite(result["wall_s"])
    assert isinstance(result["summary"], str) and result["summary"].strip()
    assert f"== {name} ==" in proc.stdout
    assert f"report: {out / 'results.md'}" in proc.stdout    # quick runs never render docs/results.md
    check_report(out / "results.md", measured=name)


def check_report(path: Path, measured: str) -> None:
    """The rendered report: one section per benchmark, the measured one with its command, links that resolve."""
    text = path.read_text()
    assert text.startswith("# Results\n")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == len(BENCHES)
    for name in BENCHES:
        [section] = [s for s in sections if f"(`sao bench {name}`)" in s.splitlines()[0]]
        if name == measured:
            assert f"Measured by `sao bench {name} --quick` (quick smoke version)" in section
            assert "Not measured" not in section
        else:
            assert f"Not measured: there is no `{name}.json`" in section
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (path.parent / target).is_file(), target


def test_engine_bench_budgets_fit_the_servers_context():
    """The engine bench asks the reference server (which, as SGLang, refuses prompt + max_new_tokens
    past --max-context) only for what fits; without a context its workload is unchanged."""
    from bench.engine import workload

    full = workload(quick=False, vocab=100)
    capped = workload(quick=False, vocab=100, context=100)
    assert [p for p, _ in capped] == [p for p, _ in full]
    assert max(len(p) + b for p, b in full) > 100 >= max(len(p) + b for p, b in capped)
    assert all(b == min(n, 100 - len(p)) for (p, b), (_, n) in zip(capped, full))
