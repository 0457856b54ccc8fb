"""`sao plan RECIPE.toml --gpus N --gpu h100|h200|b200`: memory per GPU for the recipe's layout, predicted
seconds per step (rollout, train, weight sync and their overlap), and layouts that fit.

Exit code 0 when the recipe's own layout fits, 1 when it does not (the suggestions say what would), 2 on a
bad argument (one line). Formulas: parallel/planner/ and docs/cluster.md.

A plan is often made away from the cluster (a laptop, for a recipe whose model.path and datasets live on
the cluster's storage), so of the recipe's machine checks it runs only those this checkout's code
decides: the task, the eval sources' task names and schemes, the model presets (exit 2, one line). Paths
and rollout.reward_fn imports are `sao launch`'s (at submit) and `sao train`'s (launch/validate.py).
"""
from __future__ import annotations

import sys


def register(sub) -> None:
    parser = sub.add_parser("plan", help="Memory per GPU (weights, grads, optimizer, activations, KV) and layouts that fit")
    parser.add_argument("recipe", help="recipe .toml (model.shape_preset or a local model.path)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=8")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs in the allocation, >= 1 (default launch.nodes x launch.gpus_per_node)")
    parser.add_argument("--gpu", default="h100", help="GPU model: h100, h200 or b200 (parallel/planner/hardware.py)")
    parser.add_argument("--transport", default=None, choices=["broadcast", "sharded"],
                        help="weight-sync transport the step uses (default: weight_sync.method; both are printed)")
    parser.add_argument("--senders", type=int, default=0,
                        help="sharded transport: trainer ranks sending in parallel (default: every trainer rank, each its share)")
    parser.add_argument("--prompt-tokens", type=float, default=None, help="mean prompt length (default max_prompt_len/2)")
    parser.add_argument("--response-tokens", type=float, default=None,
                        help="mean response length (default max_new_tokens/2)")
    parser.add_argument("--optimizer-offload", action="store_true", default=None,
                        help="Adam state and fp32 master on the host (CPU Adam); default: parallel.optimizer_offload")
    parser.add_argument("--critic-placement", default=None, choices=["shared", "swap"],
                        help="shared: policy and critic resident together; swap: only the model being updated "
                             "(default: critic.placement)")
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"], help="engine KV cache dtype")
    parser.add_argument("--suggest", type=int, default=5, help="how many fitting layouts to list")
    parser.set_defaults(func=run)


def argument_problem(args) -> str:
    """One line naming a bad --gpus / --gpu / length ('' when they are fine)."""
    from parallel.planner import GPUS

    if args.gpus is not None and args.gpus < 1:
        return f"--gpus {args.gpus}: need at least 1 GPU (or leave it out to use launch.nodes x launch.gpus_per_node)"
    if args.gpu not in GPUS:
        return f"--gpu {args.gpu!r} is unknown; use one of {', '.join(GPUS)}"
    if args.senders < 0:
        return f"--senders {args.senders}: use 1 or more (0 = every trainer rank)"
    for name in ("prompt_tokens", "response_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"--{name.replace('_', '-')} {value:g}: must be positive"
    return ""


def run(args) -> int:
    from checkpoints.arch import load_recipe
    from launch.validate import check_names
    from parallel.planner import OPTION_LADDER, make_plan, plan_input_from_recipe, search_layouts, with_options

    problem = argument_problem(args)
    if problem:
        print(f"sao plan: {problem}", file=sys.stderr)
        return 2
    recipe = load_recipe(args.recipe, args.overrides, check_files=False)
    check_names(recipe)
    placement = {"critic_placement": args.critic_placement} if args.critic_placement else {}   # else the recipe's
    inp = plan_input_from_recipe(recipe, args.gpus or 0, args.gpu, optimizer_offload=args.optimizer_offload,
                                 kv_dtype=args.kv_cache_dtype, **placement)
    plan = make_plan(inp)
    print(render_plan(plan, recipe.model.shape_preset or recipe.model.path))
    if not plan.problem:
        from sao_megatron.cli.plan_time import render_time

        print(render_time(plan, recipe, args))
    suggestions, used = [], {}
    for options in OPTION_LADDER:
        suggestions = search_layouts(with_options(inp, options), limit=args.suggest)
        if suggestions:
            used = options
            break
    print(render_suggestions(suggestions, used))
    return 0 if plan.fits else 1


def gib(value: float) -> str:
    return f"{value / 1024 ** 3:.1f}"


def count(n: float) -> str:
    """Parameter counts readable for the tiny model and the 750B alike (1.2M, 7.27B)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def table_unit(plan) -> tuple[str, float]:
    """GiB for real models, MiB when every row is under a GiB (the tiny CPU model)."""
    biggest = max(m.total for m in (plan.policy, plan.critic) if m is not None)
    return ("GiB", 1024 ** 3) if biggest >= 1024 ** 3 else ("MiB", 1024 ** 2)


def render_plan(plan, model_name: str) -> str:
    from parallel.model_shapes import count_parameters

    inp = plan.inp
    counts = count_parameters(inp.cfg)
    lines = [f"model {model_name}: {count(counts.total)} parameters, {count(counts.active)} active",
             f"allocation: {inp.gpus} x {inp.gpu.name} ({inp.gpu.memory_gib} GiB): {plan.world} trainer GPUs, "
             + (f"{inp.rollout_gpus} rollout GPUs" if inp.rollout_gpus else "engines colocated")]
    if plan.problem:
        return "\n".join(lines + [f"layout {inp.layout.short()}: cannot run: {plan.problem}", "verdict: DOES NOT FIT"])
    lay = inp.layout
    fp8 = f", FP8 {inp.train.fp8} (TE)" if inp.train.fp8 != "none" else ""
    lines.append(f"layout {lay.short()}: dp {lay.data_parallel(plan.world)}, expert-dp {lay.expert_data_parallel(plan.world)}, recompute "
                 f"{inp.train.recompute}, micro-batch {inp.train.micro_batch_tokens} tokens, distributed optimizer "
                 f"{'on' if inp.train.distributed_optimizer else 'off'}, optimizer offload "
                 f"{'on' if inp.train.optimizer_offload else 'off'}"
                 + (", local kernels (unfused attention)" if inp.train.kernels == "local" else "") + fp8)
    unit, scale = table_unit(plan)
    lines.append(f"{unit + ' per GPU':<22}{'params':>9}{'weights':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'total':>9}")
    for name, mem in (("policy", plan.policy), ("critic", plan.critic)):
        if mem is not None:
            cells = "".join(f"{v / scale:>9.1f}" for v in (mem.weights, mem.gradients, mem.optimizer,
                                                          mem.activations, mem.total))
            lines.append(f"{name + f' (stage {mem.stage})':<22}{count(mem.params):>9}{cells}")
    lines.append(f"trainer peak ({'both models resident' if inp.critic_placement == 'shared' else 'one model at a time'}"
                 f" + runtime reserve): {gib(plan.trainer_total)} GiB")
    if plan.host_per_gpu:
        lines.append(f"host memory for offloaded/swapped state: {gib(plan.host_per_gpu * inp.gpus_per_node)} GiB "
                     f"per node ({inp.gpus_per_node} GPUs)")
    lines.append(render_engine(plan))
    if plan.sender is not None:
        sender = plan.sender
        lines.append(f"weight-sync sender: flat buffers {gib(sender.buffers)} + buckets {gib(sender.buckets)} + gather "
                     f"{gib(sender.gather)} = {gib(sender.need)} GiB (weight_sync.bucket_mb = "
                     f"{inp.bucket_bytes / 2 ** 20:g}, max_sender_mb = {inp.max_sender_bytes / 2 ** 20:g}); "
                     f"GPU peak during a sync {gib(plan.sync_peak)} GiB")
    lines += [f"note: {n}" for n in plan.notes]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"verdict: {verdict} (peak {gib(plan.peak)} of {inp.gpu.memory_gib} GiB per GPU)")
    return "\n".join(lines)


def render_engine(plan) -> str:
    eng, opts = plan.engine, plan.inp.engine
    return (f"engine x{plan.engines} (tp {opts.tp}, ep {opts.ep}, dp-attention {opts.dp_attention or 'off'}, "
            f"{'fp8' if opts.fp8_weights else 'bf16'} weights, {opts.kv_dtype} KV): weights {gib(eng.weights)} GiB/GPU, "
            f"KV pool {gib(max(eng.kv_pool, 0))} GiB/GPU at {eng.kv_bytes_per_token / 1024:.1f} KiB/token -> "
            f"{eng.tokens_per_engine / 1e6:.2f}M tokens per engine, in-flight need {plan.kv_demand / 1e6:.2f}M "
            f"({_kv_word(plan)})")


def _kv_word(plan) -> str:
    if not plan.kv_ok:
        return "less than one sequence"
    return "ok" if plan.engine.tokens_per_engine >= plan.kv_demand else "requests will queue"


def render_suggestions(plans, options: dict) -> str:
    if not plans:
        return "no layout over tp/pp/cp/ep fits this allocation, even with optimizer offload and critic swap: add GPUs"
    extra = " + ".join(f"{k.replace('_', ' ')} = {v}" for k, v in options.items())
    head = "layouts that fit" + (f" (needs {extra})" if extra else "") + ":"
    rows = [f"  {p.inp.layout.short():<28} peak {gib(p.peak)} GiB" for p in plans]
    return "\n".join([head] + rows)
