"""The wire of shard writes between one trainer sender (group rank 0) and one engine TP rank.

A stand-in, over a world-(1 + k) gloo/nccl group per sender, for the one-sided writes SGLang's
transfer-engine route makes into a rank's registered weights (docs/weights.md, "Shard writes"): the
engine rank runs a passive loop that applies whatever arrives and only speaks when asked for an ack.
Messages from the sender to group rank j, in order on that pair:
- BUCKET: header int64[3] = (BUCKET, meta bytes, payload bytes); meta = UTF-8 JSON
  {"names", "dtypes", "shapes"} of the rank-local slices; payload = their bytes concatenated in that
  order (aligned as buckets.py explains: descending element size);
- END: header (END, 0, 0); the rank answers int64[3] = (ok, payload bytes since the last END,
  message bytes) and, when message bytes > 0, the UTF-8 error text (the first failure);
- CLOSE: header (CLOSE, 0, 0); the rank's loop ends (before the group is destroyed).
The engine rank's side is `join_and_serve(entry, address, target, ...)`: any `target` with `rank` and
`apply(meta, payload)` (raising ValueError or KeyError for a slice that is not its own).
"""
from __future__ import annotations

import datetime
import json
import threading
from typing import Optional

import torch

from .buckets import ReceiveBuffer

BUCKET, END, CLOSE = 1, 2, 3
# A rank waits for the next push as long as registered memory would: between pushes the trainer trains.
IDLE_WAIT = datetime.timedelta(days=7)


def _send(tensor: torch.Tensor, dst: int, group) -> None:
    import torch.distributed as dist

    dist.send(tensor, dst=dst, group=group)


def _recv(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.recv(tensor, src=src, group=group)
    return tensor


def _text(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def send_bucket(meta: dict, payload: torch.Tensor, dst: int, group):
    """Send one bucket to group rank `dst`; returns the payload's pending send (wait before reusing it)."""
    import torch.distributed as dist

    raw = _text(json.dumps(meta).encode())
    _send(torch.tensor([BUCKET, raw.numel(), payload.numel()], dtype=torch.int64), dst, group)
    _send(raw, dst, group)
    return dist.isend(payload, dst=dst, group=group)


def send_control(kind: int, dst: int, group) -> None:
    _send(torch.tensor([kind, 0, 0], dtype=torch.int64), dst, group)


def recv_ack(src: int, group) -> tuple[bool, int, str]:
    """(ok, payload bytes the rank received since the last END, its first error or '')."""
    ok, nbytes, msg_len = _recv(torch.empty(3, dtype=torch.int64), src, group).tolist()
    message = bytes(_recv(torch.empty(msg_len, dtype=torch.uint8), src, group).numpy()).decode() if msg_len else ""
    return bool(ok), nbytes, message


def recv_message(group, buffer: Optional[ReceiveBuffer] = None) -> tuple[int, dict | None, torch.Tensor | None]:
    """The engine rank's side: the next (kind, meta, payload) from group rank 0; the payload lands in
    `buffer` (reused: valid until the next message) when given."""
    kind, meta_len, payload_len = _recv(torch.empty(3, dtype=torch.int64), 0, group).tolist()
    if kind != BUCKET:
        return kind, None, None
    meta = json.loads(bytes(_recv(torch.empty(meta_len, dtype=torch.uint8), 0, group).numpy()).decode())
    payload = buffer.take(payload_len) if buffer is not None else torch.empty(payload_len, dtype=torch.uint8)
    return kind, meta, _recv(payload, 0, group)


def send_ack(ok: bool, nbytes: int, message: str, group) -> None:
    raw = _text(message.encode())
    _send(torch.tensor([int(ok), nbytes, raw.numel()], dtype=torch.int64), 0, group)
    if raw.numel():
        _send(raw, 0, group)


def serve(group, target) -> None:
    """The rank's passive loop: apply buckets, ack each END, stop at CLOSE or when the group breaks."""
    received, error = 0, ""
    buffer = ReceiveBuffer()   # every bucket lands here; target.apply copies each slice out
    while True:
        try:
            kind, meta, payload = recv_message(group, buffer)
        except Exception:   # noqa: BLE001 - the sender's side fails and names this rank
            return
        if kind == CLOSE:
            return
        if kind == END:
            send_ack(not error, received, error, group)
            received, error = 0, ""
            continue
        received += payload.numel()
        if not error:
            try:
                with torch.no_grad():
                    target.apply(meta, payload)
            except (KeyError, ValueError) as err:   # the target's refusal of a slice that is not its own
                error = f"tp_rank {target.rank}: {str(err).strip(chr(34))}"


def join_and_serve(entry: dict, address: str, target, backend: str, timeout_s: float):
    """Join the sender's group as entry["group_rank"] (rendezvous within timeout_s, then wait for writes
    without a deadline) and start the rank's loop in a daemon thread; returns the group."""
    from torch.distributed import distributed_c10d as c10d

    url = f"tcp://{address}:{entry['master_port']}"
    name, rank, world = entry["group_name"], entry["group_rank"], entry["world_size"]
    try:
        store, rank, world = next(c10d.rendezvous(url, rank, world, timeout=datetime.timedelta(seconds=timeout_s)))
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend),
                                                  c10d.PrefixStore(name, store), group_name=name, timeout=IDLE_WAIT)
    except Exception as err:   # rendezvous timeouts come as RuntimeError / DistStoreError / TimeoutError
        raise RuntimeError(f"shard group {name!r} at {url} (rank {rank}/{world}) did not form within "
                           f"{timeout_s:.0f}s: {err}") from err
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    threading.Thread(target=serve, args=(group, target), daemon=True, name=f"sao-shard-writes-{name}").start()
    return group
