"""Recipe checks against this machine: names the code must know and paths that must exist.

They run with the file checks (load_recipe(check_files=True): `sao train`, `sao eval`), before a run
directory or a model is made, so an unknown task, an eval set that names nothing, an unimportable
reward_fn or a resume path with no checkpoint stops with one line instead of failing steps later.

The registries live in higher layers (tasks in rollout/rewards/tasks.py, agentic evals in
sao_megatron/evaluation/runner.py). They are reached by import path at check time, as a reward_fn is,
so this bottom layer imports none of them.
"""
from __future__ import annotations

from pathlib import Path

from ..imports import resolve_import_path
from .errors import ConfigError

TASK_LOOKUP = "rollout.rewards.tasks:get_task"
AGENTIC_EVALS = "sao_megatron.evaluation.runner:AGENTIC_EVALS"
FAMILIES = "checkpoints.arch:ARCHS"
ONLINE_TASK = "online"   # the changing environment (rollout/rewards/environments.py), not in the task table
TASK_SCHEMES = ("task", "tool_task")   # eval sources whose argument is a built-in task, not a file


def check_installed(recipe) -> None:
    rollout = recipe.rollout
    check_model_presets(recipe.model)
    if rollout.task and not rollout.dataset:
        check_task("rollout.task", rollout.task)
    for name, path in (("rollout.reward_fn", rollout.reward_fn),
                       ("algorithm.loss", custom_import_path(recipe.algorithm.loss)),
                       ("rollout.generate_fn", rollout.generate_fn), ("rollout.agent", custom_import_path(rollout.agent))):
        if path:
            check_importable(name, path)
    for scheme, path in recipe.eval.agentic_evals.items():
        check_importable(f"eval.agentic_evals.{scheme}", path)
    for source in recipe.eval.datasets:
        check_eval_source(source, recipe.eval.agentic_evals)
    check_resume_path(recipe.checkpoint.resume)
    if recipe.logging.tensorboard:
        check_package("logging.tensorboard", "tensorboard", "pip install tensorboard, or set logging.tensorboard = false")
    if recipe.run.debug == "train-only" and not Path(recipe.run.debug_dir).is_dir():
        raise ConfigError("run.debug_dir", f"{recipe.run.debug_dir} does not exist",
                          "point it at the rollouts/ directory of a rollout-only run")


def check_task(field: str, name: str) -> None:
    if name == ONLINE_TASK:
        return
    get_task = resolve_import_path(TASK_LOOKUP, field)
    try:
        get_task(name)
    except (ValueError, KeyError) as err:
        problem, _, fix = str(err).partition("; ")
        raise ConfigError(field, problem.removeprefix("rollout.task: "),
                          fix or "use a built-in task such as 'countdown'") from None


def check_model_presets(model) -> None:
    """model.init_preset names one of the family's init-model presets (it is used only when model.path
    has no config.json, after the run directory exists); model.shape_preset one of its named shapes.
    An unregistered model.arch is left to checkpoints.arch.check_recipe_arch, which names it."""
    family = resolve_import_path(FAMILIES, "model.arch").get(model.arch)
    if family is None:
        return
    for field, value, known in (("model.init_preset", model.init_preset, family.presets),
                                ("model.shape_preset", model.shape_preset, family.shapes)):
        if value and value not in known:
            raise ConfigError(field, f"{value!r} is not a {model.arch} {field.split('.')[1].replace('_', ' ')}",
                              f"use one of {', '.join(sorted(known)) or '(none)'} (checkpoints/arch/{model.arch}.py)")


def check_eval_source(source: str, own_schemes: dict = {}) -> None:   # noqa: B006 - read only
    """'task:NAME' or 'tool_task:NAME', 'SCHEME:FILE' of a registered agentic eval, or an existing
    jsonl/parquet file."""
    scheme, sep, arg = source.partition(":")
    if sep and scheme in TASK_SCHEMES:
        check_task("eval.datasets", arg)
        return
    if sep:
        schemes = {**resolve_import_path(AGENTIC_EVALS, "eval.datasets"), **own_schemes}
        if scheme not in schemes:
            raise ConfigError("eval.datasets", f"unknown source scheme {scheme!r} in {source!r}",
                              f"use one of task, {', '.join(sorted(schemes))}, or a file path without ':'")
        if not Path(arg).exists():
            raise ConfigError("eval.datasets", f"{scheme} task file {arg} does not exist",
                              f"point '{scheme}:' at an existing jsonl file")
        return
    if not Path(source).exists():
        raise ConfigError("eval.datasets", f"{source} does not exist",
                          "point it at a jsonl/parquet file, or use 'task:NAME' for a built-in task")


def check_resume_path(resume: str) -> None:
    """An explicit checkpoint.resume must be a published checkpoint (its content is verified later,
    before the models are built: sao_megatron/trainer/checkpointing.py)."""
    if resume in ("auto", "never"):
        return
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError("checkpoint.resume", f"{resume} does not exist",
                          "point it at a checkpoint directory (<run_dir>/checkpoints/step_N), or use 'auto' or 'never'")
    if not (path / "manifest.json").is_file():
        raise ConfigError("checkpoint.resume", f"{resume} has no manifest.json (not a complete checkpoint)",
                          "point it at a step_N directory written by sao train, or use 'auto'")


def check_package(field: str, package: str, fix: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(field, f"needs the {package!r} package, which is not installed", fix)


def check_importable(field: str, path: str) -> None:
    try:
        resolve_import_path(path, field, want_callable=True)
    except ValueError as err:
        problem, _, fix = str(err).partition("; fix: ")
        raise ConfigError(field, problem.removeprefix(f"{field}: "), fix or "check the import path") from None


def custom_import_path(loss: str) -> str:
    return loss if ":" in loss else ""
