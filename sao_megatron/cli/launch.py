"""`sao launch`: render the slurm job of a recipe and submit it (the logic lives in launch/cli.py)."""
from __future__ import annotations


def register(sub) -> None:
    from launch.cli import add_arguments

    parser = sub.add_parser("launch", help="Render (and submit) the sbatch script of a recipe")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from launch.cli import run as run_launch

    return run_launch(args)
