"""Every benchmark's quick mode runs and writes a well-formed results/NAME.json (numbers are never
asserted as timings: only that they exist and are finite where they must be)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.cli.bench import BENCHES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", BENCHES)
def test_quick_benchmark_writes_results(name, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "bench", name, "--quick",
                           "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["bench"] == name and result["quick"] is True
    assert result["command"] == f"sao bench {name} --quick"
    assert result["machine"]["cpus"] >= 1 and math.isfinite(result["wall_s"])
    assert isinstance(result["summary"], str) and result["summary"].strip()
    assert f"== {name} ==" in proc.stdout
