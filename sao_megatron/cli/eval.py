"""`sao eval RECIPE.toml --checkpoint HF_DIR|RUN_CHECKPOINT`: avg@k and pass@k on the recipe's eval sets.

A run checkpoint (runs/NAME/checkpoints/step_N, its `latest` pointer, or runs/NAME) is first exported
to runs/NAME/hf/step_N as `sao export` does (kept, and reused while it is whole and of that checkpoint),
so a checkpoint and its export are served the same weights and score the same.

Agentic sets (e.g. code_repair:FILE) also write one line per episode (score, error, task) to
<out stem>_episodes.jsonl next to the results.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("eval", help="Evaluate an HF checkpoint on held-out sets (avg@k, pass@k)")
    parser.add_argument("recipe", help="recipe TOML (eval.datasets, eval.k, rollout sampling settings)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.k=16")
    parser.add_argument("--checkpoint", required=True,
                        help="HF model directory, or a run checkpoint (runs/NAME/checkpoints/step_N or .../latest)")
    parser.add_argument("--out", default="", help="write results JSON here (default: <run_dir>/eval.json)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from checkpoints.arch import load_recipe
    from sao_megatron.core.config import ConfigError

    try:
        model_dir = hf_dir_of(args.checkpoint)
    except (ValueError, FileNotFoundError) as err:
        print(f"sao eval: --checkpoint {args.checkpoint}: {err}", file=sys.stderr)
        return 2
    # sft.steps=0: eval runs no SFT, so an sft.dataset relative to another directory is not its concern
    recipe = load_recipe(args.recipe, list(args.overrides) + [f"model.path='{model_dir}'", "sft.steps=0"])
    if not recipe.eval.datasets:
        raise ConfigError("eval.datasets", "no evaluation sets",
                          "add e.g. eval.datasets=['task:arithmetic'], jsonl files or 'code_repair:FILE.jsonl'")
    _check_agentic_sets(recipe)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)       # the engines' logs go there
    episodes: list = []
    results = asyncio.run(_evaluate(recipe, episodes))
    out = Path(args.out or recipe.run_dir / "eval.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for key, value in sorted(results.items()):
        print(f"{key:40s} {value:.4f}")
    print(f"wrote {out}", file=sys.stderr)
    if episodes:
        details = out.with_name(out.stem + "_episodes.jsonl")
        details.write_text("".join(json.dumps(e) + "\n" for e in episodes))
        print(f"wrote {details} (one line per agentic episode: score, error, task)", file=sys.stderr)
    return 0


def hf_dir_of(checkpoint: str) -> Path:
    """The HF directory to serve for --checkpoint: itself, or a run checkpoint's export (made if needed)."""
    from checkpoints.run_export import NotARunCheckpoint, export_is_current, find_run_checkpoint, is_hf_dir

    if is_hf_dir(checkpoint):
        return Path(checkpoint)
    try:
        ckpt = find_run_checkpoint(checkpoint)
    except NotARunCheckpoint as err:
        raise ValueError(f"{err}; nor is it an HF model directory (config.json and safetensors); fix: pass "
                         "either") from None
    out = ckpt.hf_dir("policy")
    if export_is_current(out, ckpt.source("policy")):
        print(f"sao eval: serving {out}, the export of {ckpt.step_dir}", file=sys.stderr)
        return out
    from .export import export_run_checkpoint

    print(f"sao eval: exporting {ckpt.step_dir} to {out}", file=sys.stderr)
    return export_run_checkpoint(ckpt, out, "policy")


def _check_agentic_sets(recipe) -> None:
    """Load agentic task files before any engine starts, so a wrong path fails in seconds."""
    from sao_megatron.evaluation.runner import agentic_eval_for

    for source in recipe.eval.datasets:
        agentic_eval_for(source, recipe.eval, recipe.rollout)


async def _evaluate(recipe, episodes: list) -> dict:
    from transformers import AutoTokenizer

    from sao_megatron.evaluation.runner import evaluate_all
    from sao_megatron.trainer.engines import start_engines

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    engines, handles = await start_engines(recipe, recipe.run_dir)
    try:
        return await evaluate_all(engines, tokenizer, recipe.eval, recipe.rollout, seed=recipe.run.seed,
                                  episodes=episodes, context_length=recipe.model.max_seq_len)
    finally:
        for engine in engines:
            await engine.close()
        for handle in handles:
            handle.stop()
