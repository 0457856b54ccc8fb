"""The CPU-checkable parts of the GPU check kit (`make gpu-check`, docs/gpu.md):
- the reference server's --device flag: refused with a one-line fix where it cannot work;
- a gloo weight-update group receives on the CPU whatever device the server runs on (nccl receives on it);
- the wheelhouse builder keeps under its cap and says which wheel broke it;
- the device-side script runs its non-GPU logic (collect-only) and writes its summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rollout.engines.reference_server.server import ServeOptions, check_options

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_a_gpu_names_the_fix(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--device cuda: this machine has no CUDA; use --device cpu"):
        check_options(ServeOptions(model=str(tiny_model_dir), device="cuda"))


@pytest.mark.parametrize("device, needle", [("gpu0", "is not a device"), ("meta", "cpu or cuda only")])
def test_bad_device_is_refused(tiny_model_dir, device, needle):
    with pytest.raises(ValueError, match=needle):
        check_options(ServeOptions(model=str(tiny_model_dir), device=device))


def test_cpu_device_passes(tiny_model_dir):
    check_options(ServeOptions(model=str(tiny_model_dir), device="cpu"))


def test_gloo_group_receives_on_the_cpu_even_for_a_gpu_server():
    from parallel.distributed import free_port
    from rollout.engines.reference_server.weight_group import (destroy_weight_update_group, init_weight_update_group,
                                                       receive_tensors)

    group = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "kit_test", "gloo", timeout_s=30)
    try:
        got = receive_tensors(["a", "b"], [torch.float32, torch.bfloat16], [[2, 3], [4]], group,
                              flattened_bucket=True, device="meta")
        single = receive_tensors(["c"], [torch.int64], [[5]], group, flattened_bucket=False, device="meta")
    finally:
        destroy_weight_update_group(group)
    assert [(n, t.device.type, t.dtype, tuple(t.shape)) for n, t in got + single] == [
        ("a", "cpu", torch.float32, (2, 3)), ("b", "cpu", torch.bfloat16, (4,)), ("c", "cpu", torch.int64, (5,))]


# -- the wheelhouse ---------------------------------------------------------------------------------

def _wheel(dest: Path, name: str = "megatron_core", version: str = "0.16.1",
           tag: str = "cp312-cp312-manylinux_2_28_x86_64", size: int = 0) -> Path:
    """A minimal installable wheel (METADATA, WHEEL, RECORD), padded with `size` incompressible bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n")
        zf.writestr(f"{info}/RECORD", "")
        if size:
            zf.writestr("pad.bin", os.urandom(size))
    return path


def _fake_pip(sizes: dict[str, int], calls: list):
    """A stand-in for `pip download`: writes the wheel the command names (no index needed)."""
    def run(cmd):
        calls.append(cmd[-1])
        name, version = cmd[-1].split("==")
        dest = Path(cmd[cmd.index("--dest") + 1])
        py = cmd[cmd.index("--python-version") + 1].replace(".", "")
        _wheel(dest, name.replace("-", "_"), version, f"cp{py}-cp{py}-manylinux_2_28_x86_64", sizes.get(cmd[-1], 0))
    return run


def test_wheelhouse_downloads_what_is_missing_prunes_the_rest_and_is_idempotent(tmp_path):
    from launch import gpu_wheels as gw

    _wheel(tmp_path, "megatron_core", "0.15.0")                       # a stale pin
    _wheel(tmp_path, "megatron_core", "0.16.1", "cp311-cp311-manylinux_2_28_x86_64")   # another Python
    calls, said = [], []
    wheels = gw.build_wheelhouse(tmp_path, ["megatron-core==0.16.1", "tomli-w==1.2.0"], cap_mib=60,
                                 python_version="3.12", run=_fake_pip({}, calls), say=said.append)
    assert calls == ["megatron-core==0.16.1", "tomli-w==1.2.0"]
    assert sorted(w.file for w in wheels) == sorted(p.name for p in tmp_path.glob("*.whl")) == [
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "tomli_w-1.2.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["python_version"] == "3.12" and len(manifest["wheels"]) == 2
    again = []
    gw.build_wheelhouse(tmp_path, ["megatron-core==0.16.1", "tomli-w==1.2.0"], python_version="3.12",
                        run=_fake_pip({}, again), say=said.append)
    assert again == []


def test_wheelhouse_over_its_cap_names_the_largest_wheel(tmp_path):
    from launch import gpu_wheels as gw

    calls = []
    with pytest.raises(gw.WheelhouseError, match=r"over its 1 MiB cap; largest: big_pkg-1.0-cp312.*\(1\.1 MiB\)"):
        gw.build_wheelhouse(tmp_path, ["small==1.0", "big-pkg==1.0"], cap_mib=1, python_version="3.12",
                            run=_fake_pip({"big-pkg==1.0": 1_200_000, "small==1.0": 1000}, calls), say=lambda s: None)
    assert not (tmp_path / "manifest.json").exists()


def test_dry_run_downloads_nothing_and_reports_the_plan(tmp_path):
    from launch import gpu_wheels as gw

    said = []
    gw.build_wheelhouse(tmp_path, ["megatron-core==0.16.1"], python_version="3.12", dry_run=True,
                        run=lambda cmd: pytest.fail("dry run downloaded"), say=said.append)
    assert said[0].startswith("would run: -m pip download --no-deps --only-binary=:all:")
    assert "--python-version 3.12" in said[0] and said[0].endswith("megatron-core==0.16.1")
    assert said[-1] == "dry run: 0 wheel(s) here, 0.0 MiB of the 60 MiB cap; 1 to download"


@pytest.mark.parametrize("files, needle", [
    ([("megatron_core", "0.16.1", "cp311-cp311-manylinux_2_28_x86_64")], "lacks megatron-core==0.16.1 for Python 3.12"),
    ([("megatron_core", "0.16.1", "cp312-cp312-manylinux_2_28_x86_64"), ("megatron_core", "0.16.0", "py3-none-any")],
     "more than one wheel of megatron-core"),
])
def test_check_wheelhouse_refuses_what_pip_would_refuse(tmp_path, files, needle):
    from launch import gpu_wheels as gw

    for name, version, tag in files:
        _wheel(tmp_path, name, version, tag)
    with pytest.raises(gw.WheelhouseError, match=needle):
        gw.check_wheelhouse(tmp_path, ["megatron-core==0.16.1"], python_version="3.12")


# -- the device-side run ----------------------------------------------------------------------------

def _tests(outcome: str, **changed) -> dict:
    from launch.gpu_check import REQUIRED

    tests = {n: {"outcome": outcome, "seconds": 1.0, "message": "needs CUDA" if outcome == "skipped" else ""}
             for n in REQUIRED}
    tests.update({n: {"outcome": o, "seconds": 1.0, "message": ""} for n, o in changed.items()})
    return tests


def test_verdict_a_kit_whose_checks_skipped_fails():
    from launch.gpu_check import verdict

    ok, line = verdict(_tests("skipped"), dry_run=False, timed_out=False, code=0)
    assert not ok and line.startswith("9 required check(s) did not pass") and line.endswith("needs CUDA")


def test_verdict_passes_only_when_every_required_check_passed():
    from launch.gpu_check import verdict

    extra = {"tests/gpu/test_te_parallel.py::test_te_spec_matches_local_spec_in_fp32": "skipped"}
    assert verdict(_tests("passed", **extra), False, False, 0) == (
        True, "all 9 required checks passed (9 passed, 1 skipped)")
    failing = {"tests/gpu/test_te_parallel.py::test_te_spec_matches_local_spec_in_fp32": "failed"}
    assert verdict(_tests("passed", **failing), False, False, 1)[1].startswith("1 failed: tests/gpu/test_te_parallel")
    assert verdict(_tests("passed"), False, True, -9)[0] is False
    some = _tests("passed")
    some.pop(next(iter(some)))
    assert verdict(some, False, False, 0)[1].startswith("1 required check(s) not collected")
    assert verdict(_tests("collected"), True, False, 0) == (
        True, "dry run: 9 GPU tests collected, the 9 required among them")


def test_junit_outcomes_name_tests_by_node_id(tmp_path):
    from launch.gpu_check import junit_outcomes

    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_kit.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('x', ['a', 'b'])\n"
        "def test_p(x):\n    assert x == 'a'\n"
        "def test_s():\n    pytest.skip('needs CUDA')\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    "--rootdir", str(tmp_path), "tests/gpu"], cwd=tmp_path, capture_output=True)
    got = {n: t["outcome"] for n, t in junit_outcomes(xml).items()}
    assert got == {"tests/gpu/test_kit.py::test_p[a]": "passed", "tests/gpu/test_kit.py::test_p[b]": "failed",
                   "tests/gpu/test_kit.py::test_s": "skipped"}
    assert junit_outcomes(tmp_path / "absent.xml") == {}


def test_pytest_past_its_budget_is_killed_with_its_children(tmp_path):
    from launch.gpu_check import run_pytest

    (tmp_path / "test_slow.py").write_text(
        "import subprocess, sys, time\n"
        "def test_slow():\n"
        f"    open({str(tmp_path / 'child.pid')!r}, 'w').write(str(subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']).pid))\n"
        "    time.sleep(600)\n")
    log = tmp_path / "log"
    code, timed_out = run_pytest([str(tmp_path / "test_slow.py"), "-q"], dict(os.environ), log, budget_s=5)
    assert timed_out and code != 0 and "killed at its 5s budget" in log.read_text()
    child = int((tmp_path / "child.pid").read_text())
    with pytest.raises(ProcessLookupError):
        _wait_gone(child)


def _wait_gone(pid: int) -> None:
    """Raise ProcessLookupError once `pid` is gone (a killed child may linger as a zombie briefly)."""
    import time

    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        if state == "Z":
            raise ProcessLookupError(pid)
        time.sleep(0.1)


def test_dry_run_installs_offline_probes_and_collects_the_required_checks(tmp_path):
    """The device-side script without a GPU: a stand-in megatron-core wheel for Python 3.12 installs
    offline by its tags, the project installs with --no-deps, the GPU tests collect, the summary says so."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    _wheel(wheels)
    env = dict(os.environ, OUT=str(out))
    result = subprocess.run([sys.executable, "-m", "launch.gpu_check", "run", "--dry-run", "--wheels", str(wheels),
                             "--python-version", "3.12"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["ok"] and summary["mode"] == "dry-run" and summary["project_install"] == "ok"
    assert summary["env"]["missing"] == [] and summary["wheels"] == [_wheel(tmp_path / "x").name]
    assert set(summary["required"]) <= set(summary["tests"])
    assert "gpu-check: PASS: dry run:" in result.stdout


def test_a_real_run_without_cuda_refuses_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    here = f"{sys.version_info.major}{sys.version_info.minor}"
    wheels = tmp_path / "wheels"
    _wheel(wheels, tag=f"cp{here}-cp{here}-manylinux_2_28_x86_64")
    result = subprocess.run([sys.executable, "-m", "launch.gpu_check", "run", "--wheels", str(wheels)], cwd=ROOT,
                            env=dict(os.environ, OUT=str(tmp_path / "out")), capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == ("gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False); run on "
                                     "a GPU machine, or add --dry-run to check the kit here")
