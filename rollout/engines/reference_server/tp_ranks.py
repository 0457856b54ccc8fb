"""The extra tensor-parallel ranks of `sao serve --tp N` on the weight-update group.

An SGLang engine with tensor parallelism N joins the trainer's weight-update group once per TP rank,
as rank ``rank_offset + tp_rank`` (model_executor/model_runner_components/weight_updater.py:124), and
every TP rank receives every broadcast (each then loads its own shard). So the group the trainer
forms has ``1 + sum of the engines' tp`` members, and a trainer that counts one rank per engine
hangs at the rendezvous.

The reference server keeps its model whole in one process, and plays TP ranks 1..N-1 with N-1 child
processes (a process can hold only one member of a named group: torch's group registry is per
process). Each child joins the group as ``rank_offset + i``, receives every bucket exactly as rank 0
does, and answers with a SHA-256 of the bytes it received; the server compares those with its own, so
an update succeeds only if every TP rank received the same tensors as the rank that loads them.
Children run on the CPU (gloo); ``--tp`` > 1 needs ``--device cpu``.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from typing import Any

import torch


def digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the names and raw bytes of the received tensors, in order."""
    sha = hashlib.sha256()
    for name, tensor in tensors:
        sha.update(name.encode())
        sha.update(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> threading.Thread:
    """Exit this process once `parent_pid` is gone. A child blocked in a broadcast would otherwise
    outlive a server that was killed (no pipe EOF reaches it there) until the group timeout."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)
    thread = threading.Thread(target=watch, daemon=True, name="sao-tp-rank-parent-watch")
    thread.start()
    return thread


def _serve_rank(conn, timeout_s: float, parent_pid: int) -> None:
    """A child's loop: join / receive / destroy commands from the server, one reply per command."""
    from rollout.weights.buckets import ReceiveBuffer

    from .weight_group import destroy_weight_update_group, init_weight_update_group, receive_tensors
    from .weights import parse_dtype

    exit_with_parent(parent_pid)
    groups: dict[str, Any] = {}
    shard: dict[str, Any] = {"groups": {}}   # shard writes (shard_writes.py): shared weights, groups
    buffer = ReceiveBuffer()                 # every broadcast bucket lands here (reused, grown when needed)
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):   # the server is gone
            return
        try:
            if command == "join":
                address, port, rank, world, name, backend = args
                groups[name] = init_weight_update_group(address, port, rank, world, name, backend, timeout_s)
                reply = ("ok", rank)
            elif command == "receive":
                names, dtypes, shapes, name, flattened = args
                received = receive_tensors(names, [parse_dtype(d) for d in dtypes], shapes, groups[name], flattened,
                                           buffer=buffer)
                reply = ("ok", digest(received))
            elif command == "destroy":
                destroy_weight_update_group(groups.pop(args))
                reply = ("ok", None)
            elif command.startswith("shard_"):
                reply = ("ok", _shard_command(command, args, shard, timeout_s))
            else:
                return
        except Exception as err:   # answered to the server, which reports it in the HTTP reply
            reply = ("error", f"{type(err).__name__}: {err}")
        conn.send(reply)


def _shard_command(command: str, args, shard: dict, timeout_s: float):
    """Shard writes on a child rank: attach the shared weights, join a sender's group, leave it."""
    from .shard_writes import ShardTarget, join_and_serve
    from .weight_group import destroy_weight_update_group

    if command == "shard_attach":
        shard["params"] = args
    elif command == "shard_join" and args is not None:
        entry, address, tp, backend = args
        target = ShardTarget(shard["params"], tp, entry["tp_rank"])
        shard["groups"][entry["group_name"]] = join_and_serve(entry, address, target, backend, timeout_s)
    elif command == "shard_destroy":
        for name in args:
            group = shard["groups"].pop(name, None)
            if group is not None:
                destroy_weight_update_group(group)
    return None


class TPRanks:
    """TP ranks 1..tp-1 as child processes; every method is called from the server's transfer thread."""

    def __init__(self, tp: int, timeout_s: float):
        self.tp = tp
        self.timeout_s = timeout_s
        self._children: list[tuple[multiprocessing.Process, Any]] = []

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for i in range(1, self.tp):
            parent, child = context.Pipe()
            process = context.Process(target=_serve_rank, args=(child, self.timeout_s, os.getpid()), daemon=True,
                                      name=f"sao-tp-rank-{i}")
            process.start()
            child.close()
            self._children.append((process, parent))

    def send(self, command: str, make_args) -> None:
        """Send `command` to every child; `make_args(tp_rank)` builds each one's arguments."""
        for i, (_, conn) in enumerate(self._children, start=1):
            conn.send((command, make_args(i)))

    def collect(self) -> list[Any]:
        """Every child's reply to the last command; RuntimeError naming the first TP rank that failed."""
        results, failures = [], []
        for i, (process, conn) in enumerate(self._children, start=1):
            if not conn.poll(self.timeout_s + 30):
                failures.append(f"TP rank {i} did not answer within {self.timeout_s + 30:.0f}s "
                                f"(process {'alive' if process.is_alive() else 'dead'})")
                continue
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                failures.append(f"TP rank {i} exited (code {process.exitcode})")
                continue
            if status == "ok":
                results.append(value)
            else:
                failures.append(f"TP rank {i}: {value}")
        if failures:
            raise RuntimeError("; ".join(failures))
        return results

    def stop(self) -> None:
        for process, conn in self._children:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
            process.join(2)
            if process.is_alive():
                process.kill()
        self._children = []
