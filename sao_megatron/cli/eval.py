"""`sao eval RECIPE.toml --checkpoint HF_DIR`: avg@k and pass@k on the recipe's eval sets."""
from __future__ import annotations

import asyncio
import json
import sys


def register(sub) -> None:
    parser = sub.add_parser("eval", help="Evaluate an HF checkpoint on held-out sets (avg@k, pass@k)")
    parser.add_argument("recipe", help="recipe TOML (eval.datasets, eval.k, rollout sampling settings)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.k=16")
    parser.add_argument("--checkpoint", required=True, help="HF model directory to evaluate")
    parser.add_argument("--out", default="", help="write results JSON here (default: <run_dir>/eval.json)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from sao_megatron.config import ConfigError, load_recipe

    recipe = load_recipe(args.recipe, list(args.overrides) + [f"model.path='{args.checkpoint}'"])
    if not recipe.eval.datasets:
        raise ConfigError("eval.datasets", "no evaluation sets", "add e.g. eval.datasets=['task:arithmetic'] or jsonl files")
    results = asyncio.run(_evaluate(recipe))
    out = args.out or str(recipe.run_dir / "eval.json")
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=2)
    for key, value in sorted(results.items()):
        print(f"{key:40s} {value:.4f}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


async def _evaluate(recipe) -> dict:
    from transformers import AutoTokenizer

    from sao_megatron.evaluation.runner import evaluate_all
    from sao_megatron.trainer.services import start_engines

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    engines, handles = await start_engines(recipe, recipe.run_dir)
    try:
        return await evaluate_all(engines, tokenizer, recipe.eval, recipe.rollout, seed=recipe.run.seed)
    finally:
        for engine in engines:
            await engine.close()
        for handle in handles:
            handle.stop()
