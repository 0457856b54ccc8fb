"""The step-time part of `sao plan`: rollout, train, weight sync (both transports) and the overlap."""
from __future__ import annotations

from dataclasses import replace


def render_time(plan, recipe, args) -> str:
    from parallel.planner.hardware import FP8_TRAIN_SPEEDUP, TRAIN_MFU
    from parallel.planner.timing import step_time, workload_from_recipe

    work = replace(workload_from_recipe(recipe, args.prompt_tokens, args.response_tokens, args.transport),
                   senders=getattr(args, "senders", 0))
    chosen = step_time(plan, work)
    other = step_time(plan, replace(work, transport="sharded" if work.transport == "broadcast" else "broadcast"))
    fp8 = plan.inp.train.fp8 != "none"
    mode = "asynchronous" if chosen.asynchronous else "one phase after the other"
    critic = f" + {work.critic_updates} critic updates" if work.critic_updates else ""
    lines = [
        f"step time on {plan.inp.gpu.name} ({mode}; mean prompt {work.prompt_tokens:g}, response "
        f"{work.response_tokens:g} tokens, {work.batch_size} samples per step; --prompt-tokens/--response-tokens):",
        f"  rollout     {chosen.rollout:8.1f} s  ({plan.engines} engine(s) x {chosen.engine_batch:.0f} sequences, "
        f"{chosen.decode_step * 1e3:.1f} ms per decode step, prefill included)",
        f"  train       {chosen.train:8.1f} s  (policy{critic}; MFU {TRAIN_MFU:g}"
        + (f" x {FP8_TRAIN_SPEEDUP:g} FP8" if fp8 else "") + f", pipeline bubble {chosen.bubble:.0%}, "
        f"recompute {plan.inp.train.recompute}, offload/swap transfers {chosen.host:.1f} s)",
    ]
    for label, t in (("weight sync", chosen), ("  instead", other)):
        lines.append(f"  {label:<11} {t.sync.total:8.1f} s  {render_sync(t.sync)}")
    lines.append(f"  step        {chosen.step:8.1f} s  (phases in series {chosen.serial:.1f} s; the overlap hides "
                 f"{chosen.overlap:.1f} s)")
    return "\n".join(lines)


def render_sync(sync) -> str:
    if sync.transport == "broadcast":
        what = f"broadcast: {sync.bytes_total / 1e9:.0f} GB to every engine GPU over one link"
    else:
        what = (f"sharded: {sync.bytes_per_engine_gpu / 1e9:.1f} GB per engine GPU, {sync.senders} senders "
                f"in parallel")
    return f"({what}; gather {sync.gather:.1f} + wire {sync.wire:.1f} + per-bucket/tensor {sync.overhead:.1f})"
