"""Make Megatron-Core 0.16.1 run on a CPU-only torch over gloo. Installed once, never on a GPU.

Megatron-Core assumes CUDA in a handful of places. Each patch below is one named function, each has a
unit test in tests/unit/parallel/test_parallel_cpu_shim.py, so a Megatron upgrade that breaks one is caught.
Each entry says which Megatron-Core assumption it answers (found by running 0.16.1 on a CPU-only torch):

1. ``torch.cuda.current_device`` -> ``"cpu"`` (Megatron allocates with ``device=current_device()``).
2. ``moe_utils.te_general_gemm = None``: the router GEMM path is taken when the name merely exists.
3. Fake ``torch.cuda`` Stream / Event / current_stream / stream() / synchronize / nvtx / empty_cache.
4. CUDA RNG -> the CPU default generator: ``torch.cuda.{get,set}_rng_state``, ``manual_seed``, and the
   tracker's private ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``.
5. A TorchFunctionMode rewriting ``device="cuda"`` (or an int device) to CPU in every torch call, plus
   ``Tensor.cuda`` / ``pin_memory`` / ``record_stream`` as no-ops.
6. Grad clipping: ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor``; replaced by a
   CPU version with the same formula (coeff = max_norm / (total_norm + 1e-6), applied if < 1).
7. Torch RMSNorm/LayerNorm under sequence parallel: Megatron asserts SP is unsupported; the norm is
   the same computation, but its grads must be summed over TP, so params get ``sequence_parallel=True``
   (finalize_model_grads all-reduces exactly the params carrying that flag).
8. EP all-to-all split sizes: gloo's ``all_to_all_single`` wants Python lists, Megatron passes
   tensors/numpy arrays.
9. ``Tensor.type()`` reports ``torch.FloatTensor`` on CPU where Megatron's distributed optimizer
   expects ``torch.cuda.FloatTensor``: the CPU spelling is translated for that check.
10. Uneven all-gather / reduce-scatter along the first dim (expert-TP groups of the alltoall
   dispatcher, TP x EP): gloo needs equal sizes, so the gather pads to the largest split and trims,
   and the reduce-scatter becomes an all-reduce of the whole tensor followed by this rank's slice.
11. ``torch.autograd.backward`` / ``Tensor.backward`` run with the device mode (5) still on, so the
   forward that activation recompute re-runs inside backward allocates on the CPU too.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def shim_needed() -> bool:
    """True on a CPU-only machine: the shim must never touch a CUDA process."""
    return not torch.cuda.is_available()


def install_cpu_shim() -> bool:
    """Apply every patch once if CUDA is absent. Returns True when the shim is (now) active."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if not shim_needed():
        return False
    patch_current_device()
    patch_cuda_streams()
    patch_cuda_rng()
    patch_tensor_methods()
    _device_mode().__enter__()  # process-wide: a mode stays pushed for the life of the process
    patch_megatron()
    _INSTALLED = True
    return True


def shim_installed() -> bool:
    return _INSTALLED


def enter_shim_in_this_thread() -> bool:
    """Install the shim if needed and push the device mode in the calling thread.

    TorchFunctionModes are thread-local: a worker thread that runs the model (the trainer's model
    thread) must call this once before touching Megatron. Returns True when the shim is active.
    """
    if not install_cpu_shim():
        return False
    if not device_mode_active():
        _CudaToCpuMode().__enter__()
    return True


def patch_megatron() -> None:
    """The Megatron-side patches (2, 6, 7, 8, 9); imports megatron.core."""
    patch_router_gemm()
    patch_grad_clipping()
    patch_torch_norm_sequence_parallel()
    patch_alltoall_splits()
    patch_tensor_type()
    patch_uneven_first_dim_collectives()


# 1 -------------------------------------------------------------------------------------------------
def patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0


# 3 -------------------------------------------------------------------------------------------------
class _FakeStream:
    """Stands in for torch.cuda.Stream: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def synchronize(self):
        pass


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def wait(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _FakeNvtx:
    @staticmethod
    def range_push(*args, **kwargs):
        pass

    @staticmethod
    def range_pop(*args, **kwargs):
        pass

    @staticmethod
    def range(*args, **kwargs):
        return contextlib.nullcontext()


def patch_cuda_streams() -> None:
    stream = _FakeStream()
    torch.cuda.Stream = _FakeStream
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.nvtx = _FakeNvtx


# 4 -------------------------------------------------------------------------------------------------
def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(state, *args, **kwargs) -> None:
    torch.default_generator.set_state(state)


def patch_cuda_rng() -> None:
    # torch.cuda.manual_seed is lazy (queued until CUDA init, which never happens): seed the CPU
    # generator directly so the tracker's per-rank states really differ.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    # The tracker warns when the CPU RNG moves inside fork(); here the "CUDA" RNG *is* the CPU one,
    # so that warning fires on every initialisation and means nothing.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


# 5 -------------------------------------------------------------------------------------------------
def _to_cpu_device(device):
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites a CUDA device argument of any torch function to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1])) + tuple(args[2:])
        if func in (torch.autograd.backward, torch.Tensor.backward) and kwargs.get("inputs") is None:
            return _backward_in_mode(*args, **kwargs)
        return func(*args, **kwargs)


def _backward_in_mode(tensors, grad_tensors=None, retain_graph=None, create_graph=False, gradient=None,
                      **_) -> None:
    """torch.autograd.backward with the device mode pushed, through the engine as Megatron's
    custom_backward does. A mode is off inside its own handler and the engine keeps the modes that
    were on when backward began, so activation recompute (model.recompute = full: forward re-run
    inside backward, e.g. get_default_causal_mask's device="cuda") would otherwise reach CUDA."""
    from torch.autograd import Variable

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grad_tensors = gradient if grad_tensors is None else grad_tensors   # Tensor.backward's name for it
    grads = grad_tensors if isinstance(grad_tensors, (tuple, list)) else (grad_tensors,) * len(tensors)
    for t, g in zip(tensors, grads):
        if g is None and t.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads))
    with _CudaToCpuMode():
        Variable._execution_engine.run_backward(tensors, grads, bool(retain_graph or create_graph), create_graph,
                                                (), allow_unreachable=True, accumulate_grad=True)


@functools.lru_cache(maxsize=1)
def _device_mode() -> _CudaToCpuMode:
    return _CudaToCpuMode()


def device_mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, _CudaToCpuMode) for m in _get_current_function_mode_stack())


def patch_tensor_methods() -> None:
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None


# 2 -------------------------------------------------------------------------------------------------
def patch_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


# 6 -------------------------------------------------------------------------------------------------
@torch.no_grad()
def clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Scale grads in place by max_norm / (total_norm + 1e-6) when that is < 1 (Megatron's formula)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for grad in grads:
            grad.mul_(coeff)


def patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu


# 7 -------------------------------------------------------------------------------------------------
def _torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                    zero_centered_gamma=False, normalization="LayerNorm"):
    if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
        raise ValueError("torch norms support neither zero_centered_gamma nor persist_layer_norm; "
                         "turn them off on CPU")
    norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if norm_cls is None:
        raise ValueError(f"normalization {config.normalization!r} has no torch norm; use RMSNorm or LayerNorm")
    norm = norm_cls(normalized_shape=hidden_size, eps=eps)
    if config.sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True  # grads summed over TP by finalize_model_grads
    return norm


def patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    WrappedTorchNorm.__new__ = _torch_norm_new  # in place: every spec holds this same class


# 8 -------------------------------------------------------------------------------------------------
def _as_list(splits):
    if splits is None or isinstance(splits, list):
        return splits
    return [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]


def all_to_all_list_splits(group, input_, output_split_sizes_=None, input_split_sizes=None):
    from megatron.core.tensor_parallel.mappings import _AllToAll

    return _AllToAll.apply(group, input_, _as_list(output_split_sizes_), _as_list(input_split_sizes))


def patch_alltoall_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.all_to_all = all_to_all_list_splits


# 9 -------------------------------------------------------------------------------------------------
_CPU_TO_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
                     "torch.HalfTensor": "torch.cuda.HalfTensor"}


def patch_tensor_type() -> None:
    original = torch.Tensor.type
    if getattr(original, "_sao_cpu_shim", False):
        return

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    type_._sao_cpu_shim = True
    torch.Tensor.type = type_


# 10 ------------------------------------------------------------------------------------------------
def gather_first_dim_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
    """All-gather along dim 0 where rank r contributes output_split_sizes[r] rows (gloo-safe)."""
    if group.size() == 1:
        return input_
    if output_split_sizes is None:
        return _ORIGINAL["gather"](input_, group, None, use_global_buffer)
    sizes = _as_list(output_split_sizes)
    longest = max(sizes)
    padded = input_.new_zeros(longest, *input_.shape[1:])
    padded[: input_.shape[0]] = input_
    pieces = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])


def reduce_scatter_first_dim_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
    """Reduce-scatter along dim 0 with uneven splits: all-reduce the whole input, keep this rank's rows."""
    if group.size() == 1:
        return input_
    if input_split_sizes is None:
        return _ORIGINAL["reduce_scatter"](input_, group, None, use_global_buffer)
    sizes = _as_list(input_split_sizes)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start:start + sizes[group.rank()]].contiguous()


_ORIGINAL: dict = {}


def patch_uneven_first_dim_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    if "gather" not in _ORIGINAL:
        _ORIGINAL["gather"] = mappings._gather_along_first_dim
        _ORIGINAL["reduce_scatter"] = mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = gather_first_dim_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_first_dim_uneven
