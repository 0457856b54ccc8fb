"""`sao train RECIPE.toml [section.key=value ...]`: validate the recipe, then run the RL loop.
`sao train --help-recipe` lists every recipe field (type, default, range, doc) and exits."""
from __future__ import annotations

import argparse


class _HelpRecipe(argparse.Action):
    """Print the recipe reference and exit, like --help (so no recipe argument is needed)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from sao_megatron.core.config.recipe_help import recipe_help

        print(recipe_help(), end="")
        parser.exit()


def register(sub) -> None:
    parser = sub.add_parser("train", help="Train a policy with SAO or a baseline from a recipe")
    parser.add_argument("--help-recipe", action=_HelpRecipe,
                        help="list every recipe field with its type, default, range and doc, then exit")
    parser.add_argument("recipe", help="recipe TOML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.lr=1e-6 rollout.batch_size=8")
    parser.add_argument("--debug", choices=["rollout-only", "train-only"], default=None,
                        help="rollout-only: save rollouts, no training; train-only: train from --debug-dir")
    parser.add_argument("--debug-dir", default=None, help="saved rollouts for --debug train-only")
    parser.add_argument("--check-weight-update-equal", action="store_true",
                        help="after every weight sync compare each engine tensor with the trainer's")
    parser.set_defaults(func=run)


def _flag_overrides(args) -> list[str]:
    extra = []
    if args.debug:
        extra.append(f"run.debug='{args.debug}'")
    if args.debug_dir:
        extra.append(f"run.debug_dir='{args.debug_dir}'")
    if args.check_weight_update_equal:
        extra.append("weight_sync.check_equal=true")
    return extra


def run(args) -> int:
    from checkpoints.arch import load_recipe

    recipe = load_recipe(args.recipe, list(args.overrides) + _flag_overrides(args))
    from sao_megatron.trainer.entry import train_from_recipe  # torch, megatron: only after validation

    return train_from_recipe(recipe)
