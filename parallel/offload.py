"""Park a model in host memory while it is idle (critic.placement = "swap").

SAO trains two models of the same size. With swap, only the one in use holds device memory: the
other's weights, gradient buffers and optimizer state (Adam moments, fp32 master copies) are copied
to host memory and their device storages are shrunk to zero bytes. Tensors keep their shapes and
views (Megatron's parameters are views into flat DDP buffers), so restoring is: grow each storage
back and copy the bytes in. Nothing is re-allocated at a new place that a view could miss.

Works storage by storage, so it is exact (bytes in, bytes out) whatever the dtype or view layout.
On a CPU-only machine the "device" is the CPU too: parking still frees the model's storages and
restores them bit for bit, which is what the tests check; the memory saving matters on GPUs.
"""
from __future__ import annotations

import torch


def _model_tensors(rl_model):
    """Every tensor a training step touches: parameters, module buffers, DDP's flat param/grad
    buffers, and the optimizer's state and master parameters."""
    for chunk in rl_model.chunks:
        module = getattr(chunk, "module", chunk)
        yield from module.parameters()
        yield from module.buffers()
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for name in ("param_data", "grad_data"):
                data = getattr(buffer, name, None)
                if isinstance(data, torch.Tensor):
                    yield data
    optimizer = rl_model.optimizer
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        for group in getattr(inner, "param_groups", []):
            yield from group["params"]
        for state in getattr(inner, "state", {}).values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class ModelParking:
    """park() moves a model's storages to host memory and frees them on the device; unpark() restores."""

    def __init__(self, rl_model):
        self.model = rl_model
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    @property
    def parked_bytes(self) -> int:
        return sum(host.numel() for _, host in self._parked)

    def _storages(self) -> list[torch.UntypedStorage]:
        seen, out = set(), []
        for tensor in _model_tensors(self.model):
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out.append(storage)
        return out

    @torch.no_grad()
    def park(self) -> None:
        if self._parked:
            return
        pin = torch.cuda.is_available()
        for storage in self._storages():
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(device_bytes, non_blocking=pin)
            self._parked.append((storage, host))
        if pin:
            torch.cuda.synchronize()
        for storage, _ in self._parked:
            storage.resize_(0)

    @torch.no_grad()
    def unpark(self) -> None:
        for storage, host in self._parked:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=True)
        if self._parked and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._parked = []
