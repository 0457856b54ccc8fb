"""`sao sft RECIPE.toml [section.key=value ...]`: supervised warm start (the recipe's [sft] section),
writing an HF model that `sao train` starts from (sao_megatron/trainer/sft.py)."""
from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("sft", help="Supervised warm start on a task's reference solutions or a jsonl of "
                                        "prompt/response pairs; writes the model `sao train` starts from")
    parser.add_argument("recipe", help="recipe TOML file with an [sft] section (see recipes/tiny_moe_cpu.toml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.steps=200 sft.lr=1e-3")
    parser.set_defaults(func=run)


def run(args) -> int:
    from checkpoints.arch import load_recipe
    from sao_megatron.core.config import ConfigError

    recipe = load_recipe(args.recipe, list(args.overrides))
    if recipe.sft.steps < 1:
        raise ConfigError("sft.steps", "is 0: nothing to train", "set sft.steps (e.g. sft.steps=200)")
    from sao_megatron.trainer.sft import sft_from_recipe, sft_output_dir  # torch, megatron: after validation

    code = sft_from_recipe(recipe)
    if code == 0:
        print(f"start RL from it: sao train {args.recipe} model.path={sft_output_dir(recipe)}")
    return code
