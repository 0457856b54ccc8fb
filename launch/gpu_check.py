"""The GPU check kit: `make gpu-check`, or these two halves where the GPU machine is offline (docs/gpu.md).

    python -m launch.gpu_check wheels [--dry-run]     # where a package index is reachable
    python3 -m launch.gpu_check run [--dry-run]       # on the GPU machine, from the repository root

`run` installs build/gpu_wheels with ``--no-index --no-deps`` and this project with ``--no-deps`` into
a target directory, probes the imports and the GPU, runs ``pytest -m gpu tests/gpu`` within a time
budget (7 minutes by default, so that the whole kit stays under 8 on one H200; not yet measured on
one), and writes gpu-check.json (the verdict and every test's outcome), gpu-junit.xml and
gpu-pytest.log under $OUT (else build/gpu_check). It passes
only if no test failed and each of the kit's REQUIRED checks passed: a kit whose checks all skipped
is a failure, not a pass. `--dry-run` needs no GPU: it installs the wheels for the device's Python
into a scratch directory, probes, and collects the GPU tests without running them.

The speed probe (tests/gpu/test_speed_probe.py, not REQUIRED: it records, it does not judge) writes
speed-probe.json under the same out dir; gpu-check.json carries it as "speed_probe" (null when it did not run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import gpu_wheels as gw

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {
    "tests/gpu/test_cuda_train_step.py::test_bf16_policy_step_replays_its_own_routes":
        "Megatron bf16 policy step replaying its own routes (agreement 1.0)",
    "tests/gpu/test_cuda_logprobs_vs_hf.py::test_fp32_trainer_matches_hf_on_cuda[qwen3_moe]": "trainer vs HF, fp32",
    "tests/gpu/test_cuda_logprobs_vs_hf.py::test_fp32_trainer_matches_hf_on_cuda[glm4_moe]": "trainer vs HF, fp32",
    "tests/gpu/test_cuda_logprobs_vs_hf.py::test_bf16_trainer_with_hf_routes_within_bf16_error[qwen3_moe]":
        "trainer vs HF, bf16",
    "tests/gpu/test_cuda_logprobs_vs_hf.py::test_bf16_trainer_with_hf_routes_within_bf16_error[glm4_moe]":
        "trainer vs HF, bf16",
    "tests/gpu/test_cuda_reference_server_sync.py::test_trained_weights_arrive_bit_exact_on_the_cuda_server[gloo]":
        "reference server on CUDA: weights equal the trainer's after the sync",
    "tests/gpu/test_cuda_reference_server_sync.py::test_cuda_server_logprobs_equal_trainer_logprobs[gloo]":
        "reference server on CUDA: logprobs equal the trainer's",
    "tests/gpu/test_optimizer_offload.py::test_offloaded_adam_matches_the_gpu_optimizer": "optimizer CPU offload",
    "tests/gpu/test_cuda_glm5_dsa.py::test_glm5_trainer_replays_the_cuda_servers_routes_and_selections":
        "tiny GLM-5 (MLA + DSA) on CUDA: trainer replays the server's routes and indexer selections",
}
SPEED_PROBE = "speed-probe.json"   # the trainer vs HF train tokens/s and TFLOP/s (bench/speed_probe.py)
PROBE = """
import importlib, importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0], "missing": []}
for mod in ("torch", "megatron.core", "transformers", "parallel.rl_model", "rollout.engines.reference_server.server",
            "rollout.weights", "pytest"):
    try:
        importlib.import_module(mod)
    except ImportError as err:
        out["missing"].append(f"{mod}: {err}")
for dist in ("torch", "megatron-core", "transformers", "sao-megatron", "transformer-engine", "sglang"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        out[dist] = None
try:
    import torch
    out["cuda_build"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except ImportError:
    out["cuda_available"], out["gpus"] = False, []
try:
    import megatron.core
    out["megatron_core_from"] = megatron.core.__file__
except ImportError:
    out["megatron_core_from"] = None
print("PROBE " + json.dumps(out))
"""


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or ROOT / "build" / "gpu_check")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_install(site: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", str(site)]


def install_wheels(wheels: list[gw.Wheel], wheel_dir: Path, site: Path, python_version: str) -> None:
    """The wheelhouse into `site`, offline. Installed by the wheels' tags for `python_version`, so a
    dry run on another Python still proves they install on the device's."""
    tags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    tags += [x for p in gw.PLATFORMS for x in ("--platform", p)]
    error = _call(_pip_install(site) + tags + [str(wheel_dir / w.file) for w in wheels])
    if error:
        raise RuntimeError(f"installing the wheelhouse failed: {error}")


def install_project(site: Path) -> str:
    """This project with --no-deps into `site` ('' or the error). Not fatal: the tests import the
    checkout itself (it comes first on the path); this checks the package installs offline."""
    return _call(_pip_install(site) + ["--no-build-isolation", str(ROOT)])


def _call(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode == 0:
        return ""
    return (result.stderr.strip().splitlines() or ["(no output)"])[-1]


def run_env(site: Path | None) -> dict:
    """The environment of the probe and pytest: the checkout, then the installed wheels; no network."""
    env = dict(os.environ)
    paths = (str(ROOT), str(site) if site else "", env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    return env


def probe(env: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=str(ROOT))
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")]
    if not lines:
        raise RuntimeError(f"the environment probe failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(lines[-1][len("PROBE "):])


def run_pytest(args: list[str], env: dict, log_path: Path, budget_s: float) -> tuple[int, bool]:
    """pytest in its own session, its output to the console and `log_path`; killed (whole group) at the
    budget. Returns (exit code, timed out)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        pump = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
        pump.start()
        try:
            code, timed_out = proc.wait(timeout=budget_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, timed_out = proc.wait(), True
        pump.join(timeout=10)
        if timed_out:
            log.write(f"\ngpu_check: pytest killed at its {budget_s:.0f}s budget\n")
    return code, timed_out


def _tee(stream, log) -> None:
    for line in stream:
        sys.stdout.write(line)
        log.write(line)
        log.flush()


def junit_outcomes(path: Path) -> dict[str, dict]:
    """node id -> {outcome: passed|failed|skipped, seconds, message} from pytest's JUnit XML."""
    if not path.is_file():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (found.get("message") or "")[:300]
                break
        outcomes[node] = {"outcome": outcome, "seconds": round(float(case.get("time", 0.0)), 2), "message": message}
    return outcomes


def collected_nodes(log_path: Path) -> dict[str, dict]:
    """node ids printed by `pytest --collect-only -q`, all marked collected."""
    lines = log_path.read_text().splitlines() if log_path.is_file() else []
    return {ln.strip(): {"outcome": "collected", "seconds": 0.0, "message": ""} for ln in lines if "::" in ln}


def verdict(tests: dict[str, dict], dry_run: bool, timed_out: bool, code: int) -> tuple[bool, str]:
    """(ok, one line): every REQUIRED check passed (collected, in a dry run) and nothing failed."""
    if timed_out:
        return False, "pytest ran past its budget and was killed; see gpu-pytest.log for the test it was in"
    absent = [n for n in REQUIRED if n not in tests]
    if absent:
        more = " ..." if len(absent) > 1 else ""
        return False, f"{len(absent)} required check(s) not collected: {absent[0]}{more}"
    failed = [n for n, t in tests.items() if t["outcome"] == "failed"]
    if failed:
        return False, f"{len(failed)} failed: {failed[0]}" + (" ..." if len(failed) > 1 else "")
    if dry_run:
        return code == 0, f"dry run: {len(tests)} GPU tests collected, the {len(REQUIRED)} required among them"
    skipped = [n for n in REQUIRED if tests[n]["outcome"] != "passed"]
    if skipped:
        return False, f"{len(skipped)} required check(s) did not pass: {skipped[0]}: {tests[skipped[0]]['message']}"
    if code != 0:
        return False, f"pytest exited with {code}; see gpu-pytest.log"
    done = sum(t["outcome"] == "passed" for t in tests.values())
    return True, f"all {len(REQUIRED)} required checks passed ({done} passed, {len(tests) - done} skipped)"


def run_gpu_tests(args, env: dict, out: Path) -> tuple[dict[str, dict], int, bool]:
    """`pytest -m gpu tests/gpu` (collect-only in a dry run): (outcomes by node id, exit code, timed out)."""
    junit, log = out / "gpu-junit.xml", out / "gpu-pytest.log"
    pytest_args = ["-m", "gpu", "tests/gpu", "-q", "-rA", f"--junitxml={junit}"]
    if args.dry_run:
        pytest_args = ["-m", "gpu", "tests/gpu", "-q", "--collect-only"]
    code, timed_out = run_pytest(pytest_args + args.pytest_args, env, log, args.budget_s)
    return (collected_nodes(log) if args.dry_run else junit_outcomes(junit)), code, timed_out


def speed_probe(out: Path) -> dict | None:
    """The speed probe's record from this run's out dir, or None (not run, e.g. a dry run, or unreadable)."""
    try:
        return json.loads((out / SPEED_PROBE).read_text())
    except (OSError, ValueError):
        return None


def cmd_wheels(args) -> int:
    gw.build_wheelhouse(Path(args.dest), cap_mib=args.cap_mib, python_version=args.python_version,
                        dry_run=args.dry_run)
    return 0


def cmd_run(args) -> int:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    python_version = args.python_version if args.dry_run else here   # a real run installs for this Python
    wheel_dir = Path(args.wheels)
    wheels = gw.check_wheelhouse(wheel_dir, cap_mib=args.cap_mib, python_version=python_version)
    site = Path(args.site) if args.site else Path(tempfile.mkdtemp(prefix="sao_gpu_site_"))
    try:
        return _run_in(site, wheels, wheel_dir, python_version, python_version == here, args)
    finally:
        if not args.site:
            shutil.rmtree(site, ignore_errors=True)


def _run_in(site: Path, wheels: list[gw.Wheel], wheel_dir: Path, python_version: str, usable: bool, args) -> int:
    """`run` once the wheelhouse is checked; `usable` = its wheels are for this interpreter."""
    start, out = time.monotonic(), out_dir()
    install_wheels(wheels, wheel_dir, site, python_version)
    project_error = install_project(site)
    env = run_env(site if usable else None)   # a dry run on another Python probes this environment's own
    facts = probe(env)
    if facts["missing"]:
        raise RuntimeError(f"imports fail with the wheelhouse installed: {facts['missing'][0]}; add the package "
                           "to launch/gpu_wheels.py WHEELS and rebuild")
    if not args.dry_run and not facts["cuda_available"]:
        raise RuntimeError("no CUDA GPU visible (torch.cuda.is_available() is False); run on a GPU machine, "
                           "or add --dry-run to check the kit here")
    (out / SPEED_PROBE).unlink(missing_ok=True)   # an earlier run's record must not pass for this one's
    tests, code, timed_out = run_gpu_tests(args, env, out)
    ok, line = verdict(tests, args.dry_run, timed_out, code)
    summary = {"ok": ok, "verdict": line, "mode": "dry-run" if args.dry_run else "run", "env": facts,
               "wheels": [w.file for w in wheels], "project_install": project_error or "ok",
               "seconds": round(time.monotonic() - start, 1),
               "pytest_exit": code, "required": REQUIRED, "tests": tests, "speed_probe": speed_probe(out)}
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"gpu-check: {'PASS' if ok else 'FAIL'}: {line} ({summary['seconds']}s; summary {out / 'gpu-check.json'})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download the wheels the GPU machine lacks into the wheelhouse")
    wheels.add_argument("--dest", default=str(ROOT / gw.DEST))
    wheels.add_argument("--dry-run", action="store_true", help="print the downloads, check what is there")
    run = sub.add_parser("run", help="install the wheelhouse offline, run the GPU tests, write the summary")
    run.add_argument("--wheels", default=str(ROOT / gw.DEST), help="the wheelhouse (default build/gpu_wheels)")
    run.add_argument("--site", default="", help="install target (default: a new temp directory)")
    run.add_argument("--budget-s", type=float, default=420.0, help="pytest is killed after this many seconds")
    run.add_argument("--dry-run", action="store_true", help="no GPU needed: install, probe, collect only")
    run.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    for p in (wheels, run):
        p.add_argument("--python-version", default=gw.PYTHON_VERSION, help="the GPU machine's Python (X.Y)")
        p.add_argument("--cap-mib", type=float, default=gw.CAP_MIB, help="wheelhouse size cap")
    args = parser.parse_args(argv)
    try:
        return cmd_wheels(args) if args.command == "wheels" else cmd_run(args)
    except (gw.WheelhouseError, RuntimeError) as err:
        print(f"gpu-check: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
