"""Run checkpoints: everything that makes a resume lossless, saved atomically with checksums.

A checkpoint is a directory `<root>/step_<step:08d>/` holding, for every trainer rank r, one file per
component `<name>.rank<r>.pt` (torch.save of the component's state_dict()), a per-rank
`manifest.rank<r>.json` (size + sha256 of those files) and a top `manifest.json` (step, world size,
component names, the rank manifests' checksums). Components are passed in by name: policy / critic
(model + optimizer state, whatever RLModel.state_dict() returns), the rollout driver (prompt cursor,
sample buffer, in-flight and partial samples as Sample.to_dict), RNG states (RngState below), trainer
step and weight version, the metric sink's run id.

Model state (RLModel) comes in two formats (checkpoint.format):
- distributed (default): a component with `distributed_checkpoint = True` writes a Megatron
  distributed checkpoint (torch_dist: model + optimizer under global tensor names) into the shared
  directory `<name>/`, every rank its shards; the top manifest lists and checksums those files. It
  loads under any layout and world size: the other (small) per-rank components then come from rank
  `r % saved_world_size` (the trainer state is the same on every rank; the driver lives on rank 0).
  Megatron's writer starts a multiprocessing manager, so ranks must not be daemonic processes.
- per_rank: state_dict_for_checkpoint() / load_checkpoint() torch-saved per rank; a resume must use
  the same layout and world size (checked at load).

Atomicity: every rank writes into `.tmp-step_<step>/`; after a barrier rank 0 writes manifest.json and
renames the directory into place, then rewrites the `latest` pointer (os.replace). A crash at any
point leaves either the old or the new checkpoint complete. keep_last prunes the oldest complete ones.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .manifest import (CheckpointCorruptError, check_sizes, describe_files, read_manifest, verify_files,
                       write_json_durably)

LATEST = "latest"
_WORKER_OS_ERROR = re.compile(r"Worker failure: \[Errno (\d+)\] ([^:]+)")
PREFIX = "step_"


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (disk full, read-only); its message is the run's one line."""


def _dist_info() -> tuple[int, int, Callable[[], None]]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.barrier
    return 0, 1, lambda: None


class RunCheckpointer:
    def __init__(self, root: str | Path, keep_last: int = 2, rank: Optional[int] = None,
                 world_size: Optional[int] = None, barrier: Optional[Callable[[], None]] = None):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last}; fix: keep at least 1 checkpoint")
        d_rank, d_world, d_barrier = _dist_info()
        self.root, self.keep_last = Path(root), keep_last
        self.rank = d_rank if rank is None else rank
        self.world_size = d_world if world_size is None else world_size
        self.barrier = barrier or d_barrier
        self.verified: dict[Path, dict] = {}   # checkpoint -> its top manifest, once verify_whole passed

    # ------------------------------------------------------------------ save
    def save(self, step: int, components: dict) -> Path:
        """Save every component's state; returns the checkpoint directory. A write the filesystem refuses
        (full, read-only, no permission) raises CheckpointWriteError (one line) after removing this save's
        temporary directory; the previous checkpoint and `latest` are untouched (nothing was renamed)."""
        final = self.root / f"{PREFIX}{step:08d}"
        tmp = self.root / f".tmp-{final.name}"
        try:
            return self._save(step, components, final, tmp)
        except BaseException as raised:   # noqa: BLE001 - only a refused write is turned into the one line
            err = _os_error_in(raised)
            if err is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = f"the previous checkpoint {previous.name} is intact" if previous is not None and previous.is_dir() \
                else "no earlier checkpoint exists"
            code = errno.errorcode.get(err.errno or 0, "")
            raise CheckpointWriteError(f"cannot write checkpoint {final.name} in {self.root}: "
                                       f"{err.strerror or err}{f' ({code})' if code else ''}; {kept}; fix: free space "
                                       "on that filesystem or make it writable, then resume") from None

    def _save(self, step: int, components: dict, final: Path, tmp: Path) -> Path:
        shared = sorted(n for n, c in components.items() if _is_distributed(c))
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in shared:
                (tmp / name).mkdir()
        self.barrier()
        names = []
        for name, component in components.items():
            if name in shared:
                component.save_distributed(tmp / name)   # collective: every rank writes its shards
                continue
            fname = f"{name}.rank{self.rank:05d}.pt"
            _save_durably(_state_of(component), tmp / fname)
            names.append(fname)
        write_json_durably(tmp / f"manifest.rank{self.rank:05d}.json", {"files": describe_files(tmp, names)})
        self.barrier()
        if self.rank == 0:
            self._publish(tmp, final, step, sorted(components), shared)
        self.barrier()
        return final

    def _publish(self, tmp: Path, final: Path, step: int, components: list[str], shared: list[str]) -> None:
        ranks = [f"manifest.rank{r:05d}.json" for r in range(self.world_size)]
        shared_files = sorted(str(p.relative_to(tmp)) for name in shared for p in (tmp / name).rglob("*") if p.is_file())
        top = {"step": step, "world_size": self.world_size, "components": components,
               "rank_manifests": describe_files(tmp, ranks), "distributed": shared,
               "distributed_files": describe_files(tmp, shared_files), "created": time.time()}
        write_json_durably(tmp / "manifest.json", top)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        (self.root / (LATEST + ".tmp")).write_text(final.name)
        os.replace(self.root / (LATEST + ".tmp"), self.root / LATEST)
        self._prune()

    def _prune(self) -> None:
        for old in self.list()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def list(self) -> list[Path]:
        """Published checkpoints (with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and (p / "manifest.json").is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Optional[Path]:
        pointer = self.root / LATEST
        if pointer.is_file():
            return self.root / pointer.read_text().strip()
        found = self.list()
        return found[-1] if found else None

    def load(self, components: dict, path: str | Path | None = None, verified: Optional[dict] = None) -> Optional[Path]:
        """Verify and load the checkpoint at `path` (default: latest) into `components`.
        Returns the directory, or None when there is nothing to resume from (and no path was asked).
        `verified`: the top manifest `verify_whole` passed for this checkpoint (every file checksummed,
        the ranks agreeing): when the manifest there is still that one, files are checked by size only."""
        ckpt = Path(path) if path is not None else self.latest()
        if ckpt is None:
            return None
        error, top = None, None
        try:
            top = self._verify(ckpt, components, verified or self.verified.get(ckpt))
        except CheckpointCorruptError as err:
            error = err
        failed = self._ranks_failed(error is not None)
        if error is not None:
            raise error
        if failed:   # this rank's files are fine, but another rank cannot resume: nobody may continue
            raise CheckpointCorruptError(f"{ckpt} failed verification on rank(s) {failed} (their error names the "
                                         f"file){self._fallback_hint(ckpt)}")
        source = self.rank % top["world_size"]
        for name, component in components.items():
            if name in top.get("distributed", []):
                component.load_distributed(ckpt / name)
                continue
            state = torch.load(ckpt / f"{name}.rank{source:05d}.pt", map_location="cpu", weights_only=False)
            _load_into(component, state)
        return ckpt

    def _verify(self, ckpt: Path, components: dict, verified: Optional[dict] = None) -> dict:
        fallback = self._fallback_hint(ckpt)
        top = read_manifest(ckpt / "manifest.json", fallback)
        check = check_sizes if verified == top else verify_files   # hashed once, by verify_whole
        shared = top.get("distributed", [])
        missing = sorted(set(components) - set(top["components"]))
        if missing:
            raise CheckpointCorruptError(f"{ckpt} has no state for component(s) {missing} "
                                         f"(it holds {top['components']})")
        per_rank_models = sorted(n for n, c in components.items() if n not in shared and _is_model(c))
        if top["world_size"] != self.world_size and per_rank_models:
            raise CheckpointCorruptError(f"{ckpt} holds {per_rank_models} per rank, saved by {top['world_size']} "
                                         f"ranks, and this run has {self.world_size}; fix: resume with the same "
                                         f"layout, or save with checkpoint.format = distributed (or convert through HF)")
        wrong = sorted(n for n in shared if n in components and not _is_distributed(components[n]))
        if wrong:
            raise CheckpointCorruptError(f"{ckpt} holds {wrong} as a distributed checkpoint; fix: resume with "
                                         "checkpoint.format = distributed")
        check(ckpt, top["rank_manifests"], fallback)
        own = read_manifest(ckpt / f"manifest.rank{self.rank % top['world_size']:05d}.json", fallback)
        check(ckpt, own["files"], fallback)
        shared_files = sorted(top.get("distributed_files", {}))   # each rank checksums its share of them
        check(ckpt, {n: top["distributed_files"][n] for n in shared_files[self.rank::self.world_size]}, fallback)
        return top

    # ------------------------------------------------------------------ resume choice
    def choose(self, resume: str) -> tuple[Optional[Path], list[str]]:
        """The checkpoint `resume` names ('auto', 'never' or a path), verified whole before any model is
        built: (path or None, one line per newer checkpoint skipped). 'auto' takes the newest that
        verifies; an explicit path that fails raises CheckpointCorruptError naming the file."""
        if resume == "never":
            return None, []
        if resume != "auto":
            self.verify_whole(Path(resume), self._fallback_hint(Path(resume)))
            return Path(resume), []
        skipped = []
        for ckpt in self._candidates():
            try:
                self.verify_whole(ckpt)
                return ckpt, skipped
            except CheckpointCorruptError as err:
                skipped.append(f"{ckpt.name} ({err})")
        if skipped:
            raise CheckpointCorruptError(f"no checkpoint in {self.root} verifies: {'; '.join(skipped)}; fix: "
                                         "restore one, or start over with checkpoint.resume=never")
        return None, []

    def _candidates(self) -> list[Path]:
        """Every step_* directory, newest first (one without a manifest too: it fails verification)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob(f"{PREFIX}*") if p.is_dir()), key=lambda p: p.name, reverse=True)

    def verify_whole(self, ckpt: Path, fallback: str = "") -> dict:
        """Every file of every rank there with its manifest size; this rank checksums its share of them.
        All ranks agree on the outcome, so none builds models for a checkpoint another rank refused."""
        error, top = None, None
        try:
            top = self._verify_whole_here(ckpt, fallback)
        except CheckpointCorruptError as err:
            error = err
        failed = self._ranks_failed(error is not None)
        if error is not None:
            raise error
        if failed:
            raise CheckpointCorruptError(f"{ckpt} failed verification on rank(s) {failed}{fallback}")
        self.verified[ckpt] = top
        return top

    def _verify_whole_here(self, ckpt: Path, fallback: str) -> dict:
        top = read_manifest(ckpt / "manifest.json", fallback)
        lacking = [k for k in ("world_size", "components", "rank_manifests") if k not in top]
        if lacking:
            raise CheckpointCorruptError(f"{ckpt / 'manifest.json'} lacks {lacking}{fallback}")
        verify_files(ckpt, top["rank_manifests"], fallback)
        files = dict(top.get("distributed_files", {}))
        for name in sorted(top["rank_manifests"]):
            files.update(read_manifest(ckpt / name, fallback).get("files", {}))
        check_sizes(ckpt, files, fallback)
        names = sorted(files)[self.rank::self.world_size]
        verify_files(ckpt, {n: files[n] for n in names}, fallback)
        return top

    def _ranks_failed(self, failed_here: bool) -> list[int]:
        """Ranks whose verification failed (all ranks learn it, so all stop together, none hangs)."""
        import torch.distributed as dist

        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [self.rank] if failed_here else []
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(failed_here)
        dist.all_reduce(flags)
        return [r for r in range(self.world_size) if flags[r]]

    def _fallback_hint(self, ckpt: Path) -> str:
        older = [p for p in self.list() if p.name < ckpt.name]
        if older:
            return f"; fix: resume from the previous checkpoint with checkpoint.resume={older[-1]}"
        return "; no earlier checkpoint exists: fix: start fresh with checkpoint.resume=never"


def _os_error_in(raised: BaseException, depth: int = 0):
    """The OSError behind a failed save: itself, its cause or context, or (Megatron's torch_dist writer)
    inside `RuntimeError(f"Worker failure: {exc}") from exc` (dist_checkpointing/strategies/
    filesystem_async.py:444-447), itself inside torch's CheckpointException(failures={rank: (exc, tb)}).
    The failures travel pickled between ranks, which drops __cause__: the errno is then read back from
    the message, which str(OSError) starts with '[Errno N] strerror'."""
    if isinstance(raised, OSError):
        return raised
    worker = _WORKER_OS_ERROR.match(str(raised)) if isinstance(raised, RuntimeError) else None
    if worker:
        return OSError(int(worker[1]), worker[2])
    if depth > 8:
        return None
    inner = [raised.__cause__, raised.__context__]
    failures = getattr(raised, "failures", None)
    if isinstance(failures, dict):
        inner += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    for exc in inner:
        if isinstance(exc, BaseException):
            found = _os_error_in(exc, depth + 1)
            if found is not None:
                return found
    return None


def _is_distributed(component) -> bool:
    return bool(getattr(component, "distributed_checkpoint", False))


def _is_model(component) -> bool:
    return hasattr(component, "state_dict_for_checkpoint")


def _state_of(component):
    """RLModel exposes state_dict_for_checkpoint() (model shards + optimizer); the rest state_dict()."""
    if hasattr(component, "state_dict_for_checkpoint"):
        return component.state_dict_for_checkpoint()
    return component.state_dict()


def _load_into(component, state) -> None:
    if hasattr(component, "load_checkpoint"):
        component.load_checkpoint(state)
    else:
        component.load_state_dict(state)


def _save_durably(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RngState:
    """Python, numpy and torch (CPU, and CUDA when present and `cuda`) generator states as one component.

    The trainer saves its CPU generators only (cuda=False), as its checkpoints always have: CUDA
    states are per visible device, and a resume under another layout would set other devices' states.
    """

    def __init__(self, cuda: bool = True):
        self.cuda = cuda

    def state_dict(self) -> dict:
        import numpy as np

        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.cuda and torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if self.cuda and "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class ValueState:
    """Wrap plain values (step, weight version, metric-sink run id) as a component: get/set callables."""

    def __init__(self, get: Callable[[], dict], set: Callable[[dict], None]):
        self._get, self._set = get, set

    def state_dict(self) -> dict:
        return dict(self._get())

    def load_state_dict(self, state: dict) -> None:
        self._set(state)


__all__ = ["RunCheckpointer", "RngState", "ValueState", "CheckpointCorruptError", "CheckpointWriteError"]
