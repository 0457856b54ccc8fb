"""The torch.distributed backend a recipe's 'auto' means on this machine."""
from __future__ import annotations


def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> nccl with CUDA, gloo without; nccl on a machine without CUDA is refused up front
    (it would fail later, inside the first collective, with a less helpful message)."""
    import torch   # at use: the recipe layer imports this package on machines without torch

    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA; this machine has none: use backend gloo")
    return backend
