"""The weight-update process group, as SGLang forms it, and the receive side of a broadcast.

Group formation (both sides must do exactly this, or the rendezvous keys differ and it times out):
rank 0 (the trainer's sender) hosts a TCPStore at ``master_address:master_port``; every member
connects with ``rendezvous("tcp://addr:port", rank, world_size)``, wraps the store in
``PrefixStore(group_name, store)`` and builds a backend group from it with
``torch.distributed.distributed_c10d._new_process_group_helper`` (SGLang's
``init_custom_process_group``). That group is NOT the default group, so a trainer's own
default/Megatron groups are untouched; `init_weight_update_group` below is usable on both sides.
Engine ranks are ``rank_offset + tp_rank`` (the reference server has one rank: ``rank_offset``).

Payload (``/update_weights_from_distributed``), all ``torch.distributed.broadcast(src=0)``:
- one tensor per name (``load_format`` null): for each (name, dtype, shape) in order, a tensor of
  that dtype and shape;
- ``load_format: "flattened_bucket"``: ONE uint8 tensor, the concatenation in ``names`` order of
  each tensor's bytes (``t.contiguous().view(-1).view(torch.uint8)``), no padding or alignment;
  its length is ``sum(numel * itemsize)``. This is SGLang's FlattenedTensorBucket layout.
"""
from __future__ import annotations

import datetime
import math
from typing import Optional

import torch

from rollout.weights.buckets import ReceiveBuffer


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "gloo", timeout_s: float = 600.0):
    """Join (or, as rank 0, host) the weight-update group; RuntimeError naming the peer on timeout."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    try:
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(group_name, store)
        group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                                  group_name=group_name, timeout=timeout)
    except Exception as err:   # rendezvous timeouts come as RuntimeError / DistStoreError / TimeoutError
        raise RuntimeError(f"weight-update group {group_name!r} at {url} (rank {rank}/{world_size}, "
                           f"{backend}) did not form within {timeout_s:.0f}s: {err}") from err
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def _broadcast(tensor: torch.Tensor, group, what: str) -> None:
    import torch.distributed as dist

    try:
        dist.broadcast(tensor, src=0, group=group)
    except Exception as err:   # gloo raises on its group timeout; name what we were waiting for
        raise RuntimeError(f"receiving {what} from rank 0 failed: {err}") from err


def receive_tensors(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], group,
                    flattened_bucket: bool, device: torch.device | str = "cpu",
                    buffer: Optional[ReceiveBuffer] = None) -> list[tuple[str, torch.Tensor]]:
    """Receive one update call's tensors in the layout above; returns (name, tensor) in order.

    An nccl group receives into `device` (the server's GPU); gloo always receives on the CPU. A flattened
    bucket lands in `buffer` (reused across calls, grown only when needed), else in a buffer of its own,
    and the tensors returned are views of it (copies only where a tensor's offset does not fit its
    element size): the caller loads them into the model, one copy, before the next call reuses the
    buffer (the server runs one update call at a time, under its gate)."""
    import torch.distributed as dist

    device = device if dist.get_backend(group) == "nccl" else "cpu"
    if not flattened_bucket:
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            # gloo refuses float8 tensors ("Invalid scalar type"): an FP8 tensor travels as its bytes, so a
            # gloo sender must broadcast t.view(torch.uint8) too; nccl (SGLang's path) takes float8 as is
            wire = tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() \
                and dist.get_backend(group) == "gloo" else tensor
            _broadcast(wire, group, f"tensor {name!r}")
            out.append((name, tensor))
        return out
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
    flat = (buffer or ReceiveBuffer()).take(sum(sizes), device)
    _broadcast(flat, group, f"flattened bucket of {len(names)} tensors ({flat.numel()} bytes)")
    return unflatten_bucket(flat, names, dtypes, shapes, copy=False)


def receive_buffer(state) -> ReceiveBuffer:
    """Rank 0's receive buffer, kept on the server state (every update call runs on its one transfer
    thread, so one buffer serves them all)."""
    if getattr(state, "receive_buffer", None) is None:
        state.receive_buffer = ReceiveBuffer()
    return state.receive_buffer


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sender's side of the layout: one uint8 tensor of all tensors' bytes in order."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors]) if tensors else \
        torch.empty(0, dtype=torch.uint8)


def unflatten_bucket(flat: torch.Tensor, names: list[str], dtypes: list[torch.dtype],
                     shapes: list[list[int]], copy: bool = True) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) per entry: copies of `flat`'s bytes, or with copy=False views of them where the
    offset is a multiple of the element size (a slice elsewhere cannot be viewed as its dtype: copied)."""
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flattened bucket has {flat.numel()} bytes, names/dtypes/shapes account for {sum(sizes)}")
    out, offset = [], 0
    for name, dtype, shape, nbytes in zip(names, dtypes, shapes, sizes):
        raw = flat[offset: offset + nbytes]
        if copy or raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()
        out.append((name, raw.view(dtype).reshape(shape)))
        offset += nbytes
    return out
