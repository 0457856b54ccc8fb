"""Trainer step time per token under TP2 and EP2 vs one rank, and memory per rank vs `sao plan`'s
prediction for the same layout. `sao bench parallel [--quick]`.

Setup: the tiny Qwen3-MoE (checkpoints/init_model.py, preset tiny or small) trains with the fixed
policy-gradient loss of parallel/layout_check.py on fixed micro-batches (the same build, load,
micro-batches and DP split as layout_check.run_layout). The single-rank reference and the 2-rank
layouts run back to back in this run on the same data; seconds per step are averaged over `steps`
steps after one warm-up step, divided by the tokens of a step.
ratio = (s/token of layout) / (s/token of one rank): < 1 means the layout is faster. On a CPU box
both ranks share the same cores, so the ratio measures parallel overhead (collectives, SP gathers,
all-to-all), not the speed-up a GPU node gives.

Memory, per rank, compared with parallel/planner's model_memory for the same layout (fp32, no
recompute, one micro-batch of rows x seq tokens in flight, no distributed optimizer, and the kernels
the model was built with: Megatron's local spec on CPU, Transformer Engine on GPUs):
- state: bytes of the parameters + Megatron main-grad buffers + optimizer state (Adam m, v, step)
  actually allocated after the warm-up step, summed over tensor storages deduplicated by data pointer
  -> predicted weights + gradients + optimizer;
- activations: bytes autograd saves for backward during one micro-batch's forward (saved-tensor
  hooks; storages deduplicated, parameters excluded), the largest micro-batch of an extra untimed
  step -> predicted activations (what the planner's activation term counts);
- peak: state + the peak bytes of the tensors allocated during one step's forward and backward
  passes, up to the optimizer's prepare_grads call (LiveTensorPeak, the CPU analogue of
  torch.cuda.max_memory_allocated) -> predicted state + activations. Backward's temporaries
  (activation grads, per-parameter grads before they reach the main-grad buffer) are in it; the
  planner has no term for them and they are small next to the saved activations here.
- peak RSS: state + growth of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs
  after malloc_trim) over the same span, listed beside it: it adds the allocator's cache and non-tensor
  memory, which the planner leaves to its fixed runtime reserve on GPUs. The whole step's growth
  (adding the optimizer step's temporaries) is recorded too.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

LAYOUTS = ["tp2", "ep2"]
ROWS = 2


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model) -> dict:
    """Parameters, main grads and optimizer state this rank holds (RLModel after one step)."""
    from parallel.optimizer import sub_optimizers

    params = [p for m in model.modules for p in m.parameters()]
    states = [t for sub in sub_optimizers(model.optimizer) for s in sub.optimizer.state.values()
              for t in s.values() if hasattr(t, "untyped_storage")]
    weights = _storage_bytes(params)
    grads = _storage_bytes([getattr(p, "main_grad", None) for p in params])
    optimizer = _storage_bytes(states)
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "total": weights + grads + optimizer}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextlib.contextmanager
def _reading_at_prepare_grads(model, read):
    """While active, `read()` runs when the optimizer's prepare_grads is called (after forward and
    backward of every micro-batch, before the optimizer step); yields the readings taken."""
    readings = []
    prepare = model.optimizer.prepare_grads

    def read_then_prepare():
        readings.append(read())
        return prepare()

    model.optimizer.prepare_grads = read_then_prepare
    try:
        yield readings
    finally:
        model.optimizer.prepare_grads = prepare


def _peak_growth(model, step) -> dict:
    """Bytes by which the process's resident set grows at its peak while `step()` runs: up to the
    optimizer's prepare_grads call (forward and backward of every micro-batch) and over the whole step."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)   # return freed heap pages, so reuse is not hidden
    except OSError:
        pass
    with _reading_at_prepare_grads(model, lambda: _status_kib("VmHWM")) as readings:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        before = _status_kib("VmRSS")
        step()
        peak = _status_kib("VmHWM")
    return {"forward_backward": (readings[0] - before) * 1024, "whole_step": (peak - before) * 1024}


def saved_activation_bytes(model, step) -> int:
    """Largest bytes autograd saves for backward during one micro-batch's forward while `step()` runs
    (storages deduplicated, parameters excluded). A forward pre-hook on the first model chunk starts
    each micro-batch's count: right for layouts with one micro-batch in flight (no pipeline)."""
    params = {p.untyped_storage().data_ptr() for m in model.modules for p in m.parameters()}
    current: dict[int, int] = {}
    largest = [0]

    def new_micro_batch(*_):
        largest[0] = max(largest[0], sum(current.values()))
        current.clear()

    def pack(t):
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                current[storage.data_ptr()] = storage.nbytes()
        return t

    handle = model.modules[0].register_forward_pre_hook(new_micro_batch)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        handle.remove()
    new_micro_batch()
    return largest[0]


class LiveTensorPeak(TorchDispatchMode):
    """The CPU analogue of torch.cuda.max_memory_allocated: the peak of the bytes held by tensor
    storages created while the mode is active (a dispatch mode sees every aten op, backward
    included). An op's output counts when its storage is new, not a view of or an in-place write to
    one of its inputs; it stops counting when the storage is freed (a weakref finalizer). Storages
    alive before (parameters, grad buffers, Adam state, the batch) are not counted: add them.
    Scratch memory inside one kernel and buffers the collectives allocate in C++ are not seen."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if size == 0 or key in self._live or storage.data_ptr() in inputs:
                continue
            self._live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


class CountInto(LiveTensorPeak):
    """A worker thread's mode that counts into another mode (one peak over every thread of a push):
    dispatch modes are per thread, so each thread the push starts enters its own CountInto(parent)."""

    def __init__(self, parent: LiveTensorPeak):
        super().__init__()
        self.parent = parent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.parent.__torch_dispatch__(func, types, args, kwargs)


def live_tensor_peak(model, step) -> dict:
    """Peak bytes of tensors `step()` allocates (LiveTensorPeak): during forward and backward (up to
    the optimizer's prepare_grads call) and over the whole step."""
    gc.collect()
    mode = LiveTensorPeak()
    with _reading_at_prepare_grads(model, lambda: mode.peak) as readings, mode:
        step()
    return {"forward_backward": readings[0], "whole_step": mode.peak}


def kernels_of(model) -> str:
    """The planner's name for the kernels `model` was built with (parallel.specs picks them)."""
    from parallel.specs import use_transformer_engine

    return "te" if use_transformer_engine(model.recipe.model.transformer_impl) else "local"


def _measure_layout(model_dir: str, name: str, hf_tensors: dict, batches: list, steps: int) -> dict:
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    teardown_model_parallel()
    try:
        model = RLModel.build(lc.make_recipe(model_dir, lc.LAYOUTS[name]), "policy")
        model.load_hf_state_dict(hf_tensors)
        local = lc.dp_shard(batches)
        model.train_step(local, lc.policy_gradient_loss)          # warm-up: allocates the Adam state
        times, growth = [], []
        for _ in range(steps):
            start = time.perf_counter()
            growth.append(_peak_growth(model, lambda: model.train_step(local, lc.policy_gradient_loss)))
            times.append(time.perf_counter() - start)
        saved = saved_activation_bytes(model, lambda: model.train_step(local, lc.policy_gradient_loss))
        allocated = live_tensor_peak(model, lambda: model.train_step(local, lc.policy_gradient_loss))
        return {"seconds_per_step": sum(times) / len(times), "state": state_bytes(model),
                "saved_activations": saved, "kernels": kernels_of(model), "peak_allocated": allocated,
                "peak_rss_growth": {k: max(g[k] for g in growth) for k in growth[0]}}
    finally:
        teardown_model_parallel()


def _measure(model_dir: str, names: list[str], steps: int, num: int, seq: int) -> dict:
    """On each rank: every layout in `names`, timed and measured."""
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.model_build import read_hf_config
    from parallel.specs import arch_shape

    hf_tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    batches = lc.fixed_batches(arch_shape(read_hf_config(model_dir)).vocab_size, num=num, rows=ROWS, seq=seq)
    return {name: _measure_layout(model_dir, name, hf_tensors, batches, steps) for name in names}


def predicted(cfg: dict, name: str, world: int, micro_batch_tokens: int, seq_len: int, kernels: str) -> dict:
    """planner.model_memory for layout `name` as layout_check builds it (fp32 policy, plain Adam)."""
    from parallel import layout_check as lc
    from parallel.planner import Layout, TrainOptions, model_memory

    spec = lc.LAYOUTS[name]
    layout = Layout(tp=spec.get("tp", 1), ep=spec.get("ep", 1), etp=spec.get("tp", 1), pp=spec.get("pp", 1))
    opts = TrainOptions(dtype="fp32", recompute="none", micro_batch_tokens=micro_batch_tokens,
                        distributed_optimizer=False, kernels=kernels, seq_len=seq_len)
    mem = model_memory(cfg, layout, world, opts)
    return {"weights": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
            "state": mem.weights + mem.gradients + mem.optimizer, "activations": mem.activations,
            "layout": layout.short(), "kernels": kernels}


def _compare(per_rank: list[dict], prediction: dict) -> dict:
    """Measured (largest rank, as the planner reports the worst rank) next to the prediction."""
    def pair(pred: float, measured: float) -> dict:
        return {"predicted": pred, "measured": measured, "ratio": measured / pred if pred else None}

    state = max(r["state"]["total"] for r in per_rank)
    acts = max(r["saved_activations"] for r in per_rank)
    peak = max(r["state"]["total"] + r["peak_allocated"]["forward_backward"] for r in per_rank)
    rss = max(r["state"]["total"] + r["peak_rss_growth"]["forward_backward"] for r in per_rank)
    total = prediction["state"] + prediction["activations"]
    return {"state": pair(prediction["state"], state), "activations": pair(prediction["activations"], acts),
            "peak": pair(total, peak), "peak_rss": pair(total, rss),
            "whole_step_peak_allocated": max(r["peak_allocated"]["whole_step"] for r in per_rank),
            "whole_step_peak_rss_growth": max(r["peak_rss_growth"]["whole_step"] for r in per_rank),
            "per_rank_state": [r["state"] for r in per_rank],
            "per_rank_saved_activations": [r["saved_activations"] for r in per_rank],
            "per_rank_peak_allocated": [r["peak_allocated"] for r in per_rank],
            "per_rank_peak_rss_growth": [r["peak_rss_growth"] for r in per_rank], "prediction": prediction}


MEMORY_METHOD = (
    "Memory per rank, measured vs `sao plan` (parallel/planner model_memory, same layout, fp32, one "
    "micro-batch in flight, the kernels the model was built with: Megatron's local spec on CPU). *state* = bytes "
    "of parameters + main-grad buffers + Adam state actually allocated (tensor storages, deduplicated) vs "
    "predicted weights + gradients + optimizer. *activations* = bytes autograd saves for backward during one "
    "micro-batch's forward (saved-tensor hooks, storages deduplicated, parameters excluded; largest micro-batch "
    "and rank) vs predicted activations. *peak* = state + the peak bytes of tensors allocated during one step's "
    "forward and backward, up to the optimizer's prepare_grads call (a dispatch mode that sees every aten op and "
    "every storage's release: the CPU analogue of torch.cuda.max_memory_allocated), vs predicted state + "
    "activations. *peak RSS* = state + growth of the process's peak resident set (VmHWM, reset before the step) "
    "over the same span: it adds the allocator's cache and non-tensor memory, which the planner leaves to its "
    "fixed runtime reserve on GPUs; it is listed, not the target. The whole step's peaks (adding the optimizer "
    "step's temporaries) are recorded in the JSON.")


def run(quick: bool = False) -> dict:
    from checkpoints.init_model import init_model
    from parallel.distributed import run_distributed_test
    from parallel.model_build import read_hf_config

    preset, steps, num, seq = ("tiny", 2, 4, 32) if quick else ("small", 5, 8, 128)
    tokens = ROWS * seq * num
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(Path(tmp) / preset, arch="qwen3_moe", preset=preset, seed=0))
        cfg = read_hf_config(model_dir)
        single = run_distributed_test(_measure, world_size=1, timeout_s=900,
                                      args=(model_dir, ["single"], steps, num, seq))
        layouts = run_distributed_test(_measure, world_size=2, timeout_s=900,
                                       args=(model_dir, LAYOUTS, steps, num, seq))
    seconds = {"single": single[0]["single"]["seconds_per_step"],
               **{n: layouts[0][n]["seconds_per_step"] for n in LAYOUTS}}
    kernels = single[0]["single"]["kernels"]
    memory = {"single": _compare([single[0]["single"]], predicted(cfg, "single", 1, ROWS * seq, seq, kernels))}
    memory |= {n: _compare([rank[n] for rank in layouts], predicted(cfg, n, 2, ROWS * seq, seq, kernels))
               for n in LAYOUTS}
    per_token = {n: s / tokens for n, s in seconds.items()}
    ratios = {n: per_token[n] / per_token["single"] for n in LAYOUTS}
    result = {"preset": preset, "tokens_per_step": tokens, "micro_batch_tokens": ROWS * seq,
              "seconds_per_step": seconds, "seconds_per_token": per_token, "ratio_vs_single": ratios,
              "memory": {"method": MEMORY_METHOD, "layouts": memory}}
    result["summary"] = _summary(result, steps)
    return result


def _summary(r: dict, steps: int) -> str:
    mib = 2**20
    lines = [f"model {r['preset']}, {r['tokens_per_step']} tokens/step, {steps} timed steps (+1 warm-up); "
             f"ratio = s/token vs 1 rank"]
    lines.append(f"{'layout':>8} {'ms/step':>9} {'us/token':>9} {'ratio':>7}")
    for name, s in r["seconds_per_step"].items():
        ratio = r["ratio_vs_single"].get(name, 1.0)
        lines.append(f"{name if name != 'single' else '1 rank':>8} {s * 1e3:9.1f} "
                     f"{r['seconds_per_token'][name] * 1e6:9.2f} {ratio:7.2f}")
    lines.append("memory per rank (MiB, largest rank): predicted by sao plan vs measured")
    lines.append(f"{'layout':>8} {'state pred':>11} {'measured':>9} {'ratio':>6}   {'activ. pred':>11} "
                 f"{'saved':>9} {'ratio':>6}   {'peak pred':>10} {'allocated':>9} {'ratio':>6}   "
                 f"{'RSS':>9} {'ratio':>6}")
    for name, m in r["memory"]["layouts"].items():
        s, a, p, q = m["state"], m["activations"], m["peak"], m["peak_rss"]
        lines.append(f"{name:>8} {s['predicted'] / mib:11.2f} {s['measured'] / mib:9.2f} {s['ratio']:6.2f}   "
                     f"{a['predicted'] / mib:11.2f} {a['measured'] / mib:9.2f} {a['ratio']:6.2f}   "
                     f"{p['predicted'] / mib:10.2f} {p['measured'] / mib:9.2f} {p['ratio']:6.2f}   "
                     f"{q['measured'] / mib:9.2f} {q['ratio']:6.2f}")
    return "\n".join(lines)
