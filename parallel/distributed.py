"""Process groups: start from torchrun / mpirun / srun, Megatron's parallel_state, teardown, test spawner.

- ``init_distributed(backend)`` reads rank and world from torchrun (RANK, WORLD_SIZE), Open MPI
  (OMPI_COMM_WORLD_*; mpi4py as a fallback) or slurm (SLURM_PROCID, SLURM_NTASKS), installs the CPU shim
  when CUDA is absent, and creates the default group with a timeout (rank 0's store listens on MASTER_ADDR alone).
- ``init_model_parallel(dims, seed)`` builds Megatron's groups from a validated ParallelDims.
- ``teardown_model_parallel()`` undoes it so the next layout can reuse the same processes.
- ``run_distributed_test(fn, world_size)`` runs ``fn`` on N spawned ranks; a rank's exception comes back
  with its traceback, a stuck rank is killed after ``timeout_s``.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sao_megatron.core.backends import resolve_backend
from sao_megatron.core.binding import bound_store
from sao_megatron.core.dims import ParallelDims
from sao_megatron.core.ports import free_port

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    source: str   # torchrun | mpirun | srun | single


def detect_rank_env(env=None) -> RankEnv:
    """Which launcher started this process, and our place in it (single process when none did)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return RankEnv(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                       int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), "mpirun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "srun")
    if "PMIX_RANK" in env or "PMI_RANK" in env:
        return _rank_env_from_mpi4py()
    return RankEnv(0, 1, 0, "single")


def _rank_env_from_mpi4py() -> RankEnv:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError("started under an MPI launcher without OMPI_* variables and mpi4py is missing: "
                           "pip install mpi4py") from err
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return RankEnv(comm.Get_rank(), comm.Get_size(), local, "mpirun")


def init_distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> RankEnv:
    """Create the default process group (idempotent). MASTER_ADDR/PORT default to 127.0.0.1:29500."""
    from .cpu_shim import enter_shim_in_this_thread

    # the shim's device mode is thread-local: a model built in this thread needs it here even when another
    # thread installed the shim first (pytest runs tests in its main thread, the trainer in a worker)
    enter_shim_in_this_thread()
    info = detect_rank_env()
    if torch.distributed.is_initialized():
        return info
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.distributed.init_process_group(
        backend=backend, rank=info.rank, world_size=info.world_size, store=_rendezvous_store(info, timeout_s),
        timeout=datetime.timedelta(seconds=timeout_s))
    return info


def _rendezvous_store(info: RankEnv, timeout_s: float):
    """The default group's TCPStore, rank 0's listening on MASTER_ADDR alone (torch's own listens on
    every interface). None under torchrun's agent store, which torch's env:// then reaches."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if info.source == "single" and info.world_size == 1:
        # alone: bind port 0, so a free port picked earlier cannot be taken by another process in between
        store = bound_store(os.environ["MASTER_ADDR"], 0, 1, True, timeout_s)
        os.environ["MASTER_PORT"] = str(store.port)
        return store
    return bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                       info.rank == 0, timeout_s)


def init_model_parallel(dims: ParallelDims, seed: int = 1234, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Megatron's groups for `dims` (validated against the world first) and its per-rank RNG states."""
    from megatron.core import parallel_state, tensor_parallel

    dims.validate(torch.distributed.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp_or_none, context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown_model_parallel() -> None:
    """Destroy Megatron's groups and the router-replay registry (both are process-global)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def single_process_port() -> None:
    """Without a launcher, pick a free MASTER_PORT so concurrent single-rank runs never collide."""
    if detect_rank_env().source == "single" and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


def data_parallel_coords() -> tuple[int, int]:
    """(rank, size) of this rank's data-parallel group; (0, 1) before Megatron's groups exist."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def pipeline_stage_group():
    """(pipeline stage, process group of every rank on that stage, this rank's index in it).

    The ranks of one stage are its tensor x data (x context) parallel group; before Megatron's groups
    exist the whole world is one stage.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, None, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return ps.get_pipeline_model_parallel_rank(), group, torch.distributed.get_rank(group)


def comm_device() -> torch.device:
    """Where small tensors for collectives must live: the GPU under nccl, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank_main(fn, rank, world_size, port, backend, args, results) -> None:
    os.setpgid(0, 0)   # a group of its own: run_distributed_test kills the rank with whatever it started
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        init_distributed(backend)
        out = fn(*args)
        results.put((rank, "ok", _to_bytes(out)))
    except BaseException as err:  # noqa: BLE001 - shipped to the parent with the traceback
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class DistributedTestError(RuntimeError):
    """A rank raised, died or did not finish in time."""


def run_distributed_test(fn: Callable[..., Any], world_size: int = 2, backend: str = "gloo",
                         timeout_s: float = DEFAULT_TIMEOUT_S, args: tuple = ()) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` spawned ranks; return each rank's result, rank order.

    `fn` must be importable (module level). The first failing rank's traceback is raised here; ranks
    still running after `timeout_s` (or after a peer failed) are killed, never waited on forever.
    Ranks are not daemonic: Megatron's distributed-checkpoint writer starts a multiprocessing manager.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, backend, args, results), daemon=False)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    finished = False
    try:
        outputs = _collect(procs, results, world_size, timeout_s)
        finished = True
        return outputs
    finally:
        _end_ranks(procs, grace_s=30.0 if finished else 0.0)


def _end_ranks(procs, grace_s: float) -> None:
    """Let each rank that reported exit by itself first: its exit shuts down what it started (Megatron's
    checkpoint writer starts a spawn Manager per rank, whose server a killed rank leaves running,
    keeping the spawn resource tracker alive with it). Then kill each rank's process group, which
    holds anything still running."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():   # also one killed before it made its group
            proc.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    outputs: dict[int, Any] = {}
    while len(outputs) < world_size:
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
        try:
            rank, status, payload = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and i not in outputs]
            if dead and results.empty():
                raise DistributedTestError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                           f"without reporting (killed for memory?)")
            continue
        if status == "error":
            raise DistributedTestError(f"rank {rank} failed:\n{payload}")
        outputs[rank] = _from_bytes(payload)
    return [outputs[r] for r in range(world_size)]


def _to_bytes(obj) -> bytes:
    """Results travel as bytes: tensors pickled by torch.multiprocessing would be shared through
    file descriptors that vanish when the rank exits before the parent reads them."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)
