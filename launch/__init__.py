"""Cluster launch: the rank bootstrap (bootstrap.py), rollout-engine placement on slurm nodes
(engines.py), the sbatch script rendered from a recipe (render.py), sbatch submission (submit.py) and
the `sao launch` / `sao-launch` command (cli.py). Guide: docs/cluster.md."""
