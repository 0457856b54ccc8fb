"""Sender side of the weight-update group (`create_sender_group`, `broadcast_flat`) and the
flattened-bucket payload (`Bucket`; how a stream becomes buckets: bucketing.py).

Group formation follows SGLang's init_custom_process_group (docs/engines.md): the sender is rank 0
and hosts a TCPStore at master_address:master_port; every engine rank r joins with
rendezvous("tcp://addr:port", r, world), wraps the store in PrefixStore(group_name, store) and builds
a backend group on it. That group is separate from the default (Megatron) process group, so the
trainer's own groups are never touched.

Payload of one bucket (load_format "flattened_bucket"): ONE uint8 tensor, the concatenation in
`names` order of each tensor's bytes (t.contiguous().view(-1).view(uint8)), no padding; its length is
sum(numel * itemsize). This is SGLang's FlattenedTensorBucket layout. Its receiver refuses a tensor
whose byte offset is not a multiple of its element size (FlattenedTensorBucket.empty,
weight_sync/tensor_bucket.py), and the layout has no room for padding, so a bucket lists its tensors
by descending element size: element sizes are powers of two, so every offset is then aligned (an
odd-length bf16 tensor before an fp32 one would not be).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from .fp8_blocks import SCALE_SUFFIX


class ReceiveBuffer:
    """A receiver's flat uint8 buffer, reused for every bucket and grown only when a bucket is larger.
    A fresh buffer per bucket pays the allocation and the page faults of every byte on each call: for a
    517 MiB payload that alone halved a plain gloo broadcast on a CPU box (issue 29). The caller must not
    keep views of it past the next `take` (the receivers copy each tensor out: unflatten, keep)."""

    def __init__(self):
        self.flat: Optional[torch.Tensor] = None

    def take(self, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """The first `nbytes` of the buffer on `device` (a new one when it is smaller or elsewhere)."""
        device = torch.device(device)
        if self.flat is None or self.flat.numel() < nbytes or self.flat.device != device:
            self.flat = None   # free the old one before the larger one is allocated
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.flat[:nbytes]


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]
    nbytes: int = 0
    header: Optional[tuple] = None   # meta() kept by release()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    def aligned(self) -> "Bucket":
        """The same tensors by descending element size (stable), so each starts at a multiple of its
        own element size in the payload."""
        order = sorted(range(len(self.names)), key=lambda i: -self.tensors[i].element_size())
        return Bucket([self.names[i] for i in order], [self.tensors[i] for i in order], self.nbytes)

    def meta(self) -> tuple[list[str], list[str], list[list[int]]]:
        """(names, dtype names as SGLang resolves them with getattr(torch, name), shapes)."""
        if self.header is not None:
            return self.header
        return (list(self.names), [str(t.dtype).removeprefix("torch.") for t in self.tensors],
                [list(t.shape) for t in self.tensors])

    def release(self) -> "Bucket":
        """Drop the tensors once the payload holds their bytes, keeping meta(): a bucket on the wire
        holds its flat payload only (the sender's memory bound, weight_sync.max_sender_mb)."""
        self.header = self.meta()
        self.tensors = []
        return self

    def flatten(self, device: str | torch.device = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload, written into `out` (a reusable uint8 buffer of >= nbytes) when given. A copy loop
        into one buffer: on CPU torch.cat of many uint8 views measured 4-9x slower (64 MiB: 170-390 ms
        vs 42 ms) and a fresh buffer per bucket pays its page faults every time. CPU to CPU the copy
        goes through numpy (copy_bytes); otherwise one copy per tensor even when it is strided (a row
        split's slice), through a typed view of its place (aligned() makes each place aligned)."""
        if out is None or out.numel() < self.nbytes:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        flat, offset = out[: self.nbytes], 0
        for t in self.tensors:
            nbytes = t.numel() * t.element_size()
            if flat.device.type == "cpu" and t.device.type == "cpu":
                copy_bytes(flat[offset: offset + nbytes], t)
            else:
                flat[offset: offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
            offset += nbytes
        return flat


    def in_place(self, device: str | torch.device) -> Optional[torch.Tensor]:
        """The payload without a copy, when the tensors already lie back to back, contiguous, in one
        storage on `device` (a tensor alone in its bucket, or views of one buffer in order): a uint8 view
        of that memory, which the caller must not write. None otherwise (flatten copies)."""
        device, end = torch.device(device), None
        for t in self.tensors:
            if t.device != device or not t.is_contiguous() or (end is not None and t.data_ptr() != end):
                return None
            end = t.data_ptr() + t.numel() * t.element_size()
        if not self.tensors or len({t.untyped_storage().data_ptr() for t in self.tensors}) != 1:
            return None
        first = self.tensors[0]
        offset = first.data_ptr() - first.untyped_storage().data_ptr()
        return torch.empty(0, dtype=torch.uint8, device=device).set_(first.untyped_storage(), offset, (self.nbytes,))


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (contiguous CPU uint8) <- the bytes of src (a CPU tensor of any dtype, its last dimension
    contiguous; strided rows allowed). Through numpy: one plain single-threaded copy that releases the
    GIL. torch's copy_ splits a large copy over its intra-op threads, and on a CPU whose cores are busy
    (the sender's other threads, receivers, other processes) that made a 66 MiB flatten take 1.3-4.8 s
    instead of 0.03 s (2 threads vs 1, this 2-core machine under load). The source is read through a
    numpy view of its raw address, not `Tensor.numpy()`: that marks the storage as shared with numpy,
    never resizable again, and the source may be a live parameter (an export without a snapshot),
    whose storage the trainer frees between steps (parallel/offload.py: resize_(0))."""
    import ctypes

    import numpy as np

    if src.dim() == 0 or src.stride(-1) != 1:
        src = src.reshape(-1) if src.dim() == 0 else src.contiguous()
    raw = src.detach().view(torch.uint8)   # a torch view: last dim = the row's bytes
    if raw.numel() == 0:
        return
    span = 1 + sum((size - 1) * stride for size, stride in zip(raw.shape, raw.stride()))
    memory = np.frombuffer((ctypes.c_uint8 * span).from_address(raw.data_ptr()), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(memory, shape=tuple(raw.shape), strides=tuple(raw.stride()),
                                           writeable=False)
    np.copyto(dst.numpy().reshape(view.shape), view)


_Q_A = ".self_attn.q_a_proj.weight"
_KV_A = ".self_attn.kv_a_proj_with_mqa.weight"


def joins_previous(previous: str, name: str) -> bool:
    """Tensors SGLang must get in the same update call as the one before them (one past the bound):
    - an FP8 scale (`..._scale_inv`, fp8_blocks.py) with its weight: the DeepSeek loader re-derives
      MLA's w_kc/w_vc from kv_b_proj's weight and scale in the call that loads them
      (models/deepseek_common/deepseek_weight_loader.py:550, :586-661);
    - MLA's kv_a_proj_with_mqa with its layer's q_a_proj (and their scales): with q LoRA the DeepSeek
      loader fuses the two into fused_qkv_a_proj_with_mqa from a cache local to one load_weights call
      and silently drops a half whose partner is in another call (deepseek_weight_loader.py:279-283,
      :438-513). `mla_a_pairs` puts them next to each other."""
    if name.endswith(SCALE_SUFFIX):
        return True
    return name.endswith(_KV_A) and previous.removesuffix(SCALE_SUFFIX) == name.removesuffix(_KV_A) + _Q_A


def pairs_with_a_neighbour(name: str) -> bool:
    """A tensor `joins_previous` may tie to the one before or after it in one update call (an FP8 scale,
    MLA's q_a_proj and kv_a_proj_with_mqa)."""
    return name.endswith((_Q_A, _KV_A, SCALE_SUFFIX))


def mla_a_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hold each layer's q_a_proj back until its kv_a_proj_with_mqa comes, then yield the two together
    (the export yields q_b_proj between them); every other tensor passes in order."""
    held: dict[str, tuple] = {}
    for item in named:   # (name, tensor), or (name, tensor, share) from a holder's export: kept whole
        name = item[0]
        if name.endswith(_Q_A):
            held[name.removesuffix(_Q_A)] = item
            continue
        if name.endswith(_KV_A) and name.removesuffix(_KV_A) in held:
            yield held.pop(name.removesuffix(_KV_A))
        yield item
    yield from held.values()   # no partner (q LoRA without kv_a: not a model SGLang fuses)


def create_sender_group(master_address: str, master_port: int, world_size: int, group_name: str,
                        backend: str, timeout_s: float):
    """Rank 0 of the weight-update group: host the store and wait for every engine rank to join."""
    from torch.distributed import distributed_c10d as c10d

    from sao_megatron.core.binding import bound_store

    timeout = datetime.timedelta(seconds=timeout_s)
    # Our own store (never torchrun's agent store), listening on master_address alone: the address the
    # engines are told, not every interface of the trainer's node.
    store, rank, world = bound_store(master_address, master_port, world_size, True, timeout_s), 0, world_size
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    # Ranks of a helper-built group are its own; register the identity map so collectives accept it.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def broadcast_flat(flat: torch.Tensor, group) -> None:
    """The sender's half of one bucket (or of the benchmark's raw baseline): rank 0 broadcasts `flat`
    to every engine rank of the weight-update group."""
    import torch.distributed as dist

    dist.broadcast(flat, src=0, group=group)
