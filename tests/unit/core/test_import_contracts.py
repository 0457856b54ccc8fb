"""The import-linter contracts in pyproject.toml hold: dependencies point one way (`lint-imports`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the [test] extra: pip install -e .[test]")

REPO = Path(__file__).resolve().parents[3]
LINT = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]   # the script installed beside python


def test_the_contracts_in_pyproject_are_kept():
    proc = subprocess.run(LINT + ["--config", str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "sao_megatron.core (the bottom layer) imports nothing else of the project KEPT" in proc.stdout
    assert "dependencies point one way: each layer imports only the layers below it KEPT" in proc.stdout
    assert "0 broken" in proc.stdout


def test_a_module_that_imports_another_layer_breaks_such_a_contract(tmp_path):
    """The same contract with a source that does import the project (algorithms -> core) is reported broken,
    so a kept contract means something."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["sao_megatron"]\n\n'
                      '[[tool.importlinter.contracts]]\nname = "control"\ntype = "forbidden"\n'
                      'source_modules = ["sao_megatron.algorithms"]\nforbidden_modules = ["sao_megatron.core"]\n')
    proc = subprocess.run(LINT + ["--config", str(config)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "control BROKEN" in proc.stdout, proc.stdout[-3000:]


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """rollout importing the trainer (an upward import) is reported by the layers contract."""
    import tomllib

    layers = next(c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                  if c["type"] == "layers")["layers"]
    assert layers.index("rollout") > layers.index("sao_megatron.trainer")   # rollout sits below the trainer
    pkg = tmp_path / "pkg"
    (pkg / "top").mkdir(parents=True)
    (pkg / "low").mkdir()
    for folder in (pkg, pkg / "top", pkg / "low"):
        (folder / "__init__.py").write_text("")
    (pkg / "low" / "leak.py").write_text("from pkg.top import x\n")
    (pkg / "top" / "x.py").write_text("")
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["pkg"]\n\n[[tool.importlinter.contracts]]\n'
                      'name = "layers"\ntype = "layers"\nlayers = ["pkg.top", "pkg.low"]\n')
    proc = subprocess.run(LINT + ["--config", str(config)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and "layers BROKEN" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
