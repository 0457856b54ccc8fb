"""One test per CPU-shim patch (parallel/cpu_shim.py), observed in a spawned process so the pytest
process itself never gets patched. A Megatron/torch upgrade that breaks a patch fails its test."""
from __future__ import annotations

import types

import pytest
import torch

from parallel import cpu_shim
from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim is never installed with CUDA")


def _observe() -> dict:
    """Runs in a spawned rank (run_distributed_test installs the shim): one observation per patch."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    obs = {"installed": cpu_shim.shim_installed(), "mode": cpu_shim.device_mode_active()}
    obs["current_device"] = torch.zeros(2, device=torch.cuda.current_device()).device.type
    obs["router_gemm"] = moe_utils.te_general_gemm
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
        event = torch.cuda.Event()
        event.record()
        torch.cuda.synchronize()
    obs["streams"] = event.query()
    torch.cuda.manual_seed(5)
    a = torch.rand(4)
    torch.manual_seed(5)
    obs["cuda_seed_is_cpu_seed"] = torch.equal(a, torch.rand(4))
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    obs["tracker_reproducible"] = torch.equal(first, second)
    obs["tracker_differs_from_default"] = not torch.equal(first, torch.rand(4))
    obs["cuda_kwarg"] = torch.empty(2, device="cuda").device.type
    obs["to_cuda"] = torch.ones(2).to("cuda").device.type
    t = torch.ones(2)
    obs["tensor_cuda_same"] = t.cuda() is t and t.pin_memory() is t
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    mopt.clip_grad_by_total_norm_fp32([p], 1.5, 6.0)
    obs["clipped_grad"] = p.grad.tolist()
    cfg = types.SimpleNamespace(layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                                sequence_parallel=True, memory_efficient_layer_norm=False, normalization="RMSNorm")
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    obs["norm_type"] = type(norm).__name__
    obs["norm_sp_flag"] = all(getattr(q, "sequence_parallel", False) for q in norm.parameters())
    obs["alltoall_patched"] = token_dispatcher.all_to_all is cpu_shim.all_to_all_list_splits
    obs["type_spelling"] = torch.zeros(1).type()
    obs["type_cast"] = str(torch.zeros(1).type(torch.float64).dtype)
    return obs


@pytest.fixture(scope="module")
def observed() -> dict:
    return run_distributed_test(_observe, world_size=1, timeout_s=240)[0]


def test_installed_with_device_mode(observed):
    assert observed["installed"] and observed["mode"]


def test_current_device_is_cpu(observed):
    assert observed["current_device"] == "cpu"


def test_router_gemm_disabled(observed):
    assert observed["router_gemm"] is None


def test_fake_streams_and_events(observed):
    assert observed["streams"] is True


def test_cuda_seed_drives_cpu_generator(observed):
    assert observed["cuda_seed_is_cpu_seed"]


def test_rng_tracker_forks_reproducibly(observed):
    assert observed["tracker_reproducible"] and observed["tracker_differs_from_default"]


def test_cuda_device_arguments_become_cpu(observed):
    assert observed["cuda_kwarg"] == "cpu" and observed["to_cuda"] == "cpu" and observed["tensor_cuda_same"]


def test_grad_clipping_cpu_formula(observed):
    coeff = 1.5 / (6.0 + 1e-6)
    assert observed["clipped_grad"] == pytest.approx([3.0 * coeff] * 4, abs=1e-7)


def test_torch_norm_allows_sequence_parallel_and_tags_params(observed):
    assert observed["norm_type"] == "RMSNorm" and observed["norm_sp_flag"]


def test_alltoall_split_sizes_become_lists(observed):
    assert observed["alltoall_patched"]
    assert cpu_shim._as_list(torch.tensor([2, 3])) == [2, 3]
    assert cpu_shim._as_list(None) is None


def test_tensor_type_cuda_spelling(observed):
    assert observed["type_spelling"] == "torch.cuda.FloatTensor" and observed["type_cast"] == "torch.float64"


def test_not_installed_when_cuda_present(monkeypatch):
    """Checked in a fresh thread: device modes are thread-local, and a model built earlier in this
    process (init_distributed enters the mode in its thread) leaves the main thread's mode on."""
    import threading

    monkeypatch.setattr(cpu_shim, "_INSTALLED", False)
    monkeypatch.setattr(cpu_shim, "shim_needed", lambda: False)
    seen = {}

    def fresh_thread():
        seen["installed"] = cpu_shim.install_cpu_shim()
        seen["entered"] = cpu_shim.enter_shim_in_this_thread()
        seen["mode"] = cpu_shim.device_mode_active()
    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert seen == {"installed": False, "entered": False, "mode": False}


def _uneven_collectives() -> dict:
    from megatron.core.tensor_parallel import mappings

    group = torch.distributed.group.WORLD
    rank = torch.distributed.get_rank()
    mine = torch.full((2 + rank, 3), float(rank + 1))  # rank 0: 2 rows, rank 1: 3 rows
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=[2, 3])
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=[2, 3])
    return {"gathered": gathered, "scattered": scattered}


def test_uneven_first_dim_collectives_on_gloo():
    out = run_distributed_test(_uneven_collectives, world_size=2, timeout_s=240)
    expect_gather = torch.cat([torch.full((2, 3), 1.0), torch.full((3, 3), 2.0)])
    summed = torch.arange(15, dtype=torch.float32).reshape(5, 3) * 3
    for rank, result in enumerate(out):
        assert torch.equal(result["gathered"], expect_gather)
    assert torch.equal(out[0]["scattered"], summed[:2]) and torch.equal(out[1]["scattered"], summed[2:])


def _thread_mode() -> dict:
    import threading

    seen = {}

    def worker():
        seen["before"] = cpu_shim.device_mode_active()
        seen["entered"] = cpu_shim.enter_shim_in_this_thread()
        seen["after"] = torch.empty(1, device="cuda").device.type

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    return seen


def test_device_mode_is_entered_per_thread():
    seen = run_distributed_test(_thread_mode, world_size=1, timeout_s=240)[0]
    assert seen == {"before": False, "entered": True, "after": "cpu"}


class _AllocatesCudaInBackward(torch.autograd.Function):
    """Backward allocates on "cuda", as Megatron's activation recompute does (get_default_causal_mask)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full((1,), 2.0, device="cuda")


def _backward_keeps_mode() -> dict:
    seen = {}
    for name, run in {"autograd_backward": lambda y: torch.autograd.backward(y),
                      "tensor_backward": lambda y: y.backward(),
                      "explicit_grad": lambda y: torch.autograd.backward(y, grad_tensors=torch.tensor(3.0))}.items():
        x = torch.ones(3, requires_grad=True)
        run(_AllocatesCudaInBackward.apply(x).sum())
        seen[name] = x.grad.tolist()
    try:
        torch.autograd.backward(_AllocatesCudaInBackward.apply(torch.ones(3, requires_grad=True)))
    except RuntimeError as err:
        seen["non_scalar"] = str(err)
    return seen


def test_backward_runs_with_the_device_mode():
    """model.recompute = full re-runs forward inside backward: it must still see the CPU rewrite."""
    seen = run_distributed_test(_backward_keeps_mode, world_size=1, timeout_s=240)[0]
    assert seen["autograd_backward"] == seen["tensor_backward"] == [2.0] * 3
    assert seen["explicit_grad"] == [6.0] * 3
    assert "only for scalar outputs" in seen["non_scalar"]
