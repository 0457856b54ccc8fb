"""The architecture registry: one `Family` per family (family.py lists its fields and their users).

Adding a family = one module in this folder defining FAMILY, plus its line in FAMILIES below
(docs/adding-a-model.md walks through it). Everything else looks families up here:
by recipe name (`family`) or by config.json model_type (`family_of_config`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from sao_megatron.core.shape import ArchShape, shape_from_hf

from . import deepseek_v3, glm4_moe, glm5, qwen3_moe
from .family import Family, SpecError
from .spec import ArchSpec

FAMILIES: tuple[Family, ...] = (qwen3_moe.FAMILY, glm4_moe.FAMILY, glm5.FAMILY, deepseek_v3.FAMILY)
ARCHS: dict[str, Family] = {f.name: f for f in FAMILIES}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def family(name: str) -> Family:
    """The family a recipe's model.arch names; unknown names list the known ones."""
    if name not in ARCHS:
        raise ValueError(f"architecture {name!r} is not registered; fix: use one of {sorted(ARCHS)} "
                         f"(checkpoints/arch/__init__.py)")
    return ARCHS[name]


def family_of_config(hf: Mapping[str, Any]) -> Family:
    """The family of an HF config.json dict, by its model_type (SpecError names the supported ones)."""
    model_type = hf.get("model_type", "")
    if model_type not in BY_MODEL_TYPE:
        raise SpecError(f"config.json model_type {model_type!r} is not supported; "
                        f"use one of {sorted(BY_MODEL_TYPE)}")
    return BY_MODEL_TYPE[model_type]


def spec_from_hf_config(cfg: dict, arch: str = "") -> ArchSpec:
    """Build the ArchSpec; `arch` defaults to the config's model_type."""
    fam = ARCHS.get(arch) if arch else BY_MODEL_TYPE.get(cfg.get("model_type", ""))
    if fam is None:
        raise ValueError(f"architecture {arch or cfg.get('model_type')!r} has no HF<->Megatron mapping; "
                         f"fix: use one of {sorted(ARCHS)}")
    return fam.spec(cfg)


def spec_from_hf_dir(path: str | Path, arch: str = "") -> ArchSpec:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found; fix: point at an HF model directory")
    return spec_from_hf_config(json.loads(cfg_path.read_text()), arch)


def arch_shape(hf: Mapping[str, Any]) -> ArchShape:
    """The layout-validation numbers of an HF config dict: core's key-name reading plus the family's
    name, MLA flag and leading dense layers."""
    fam = family_of_config(hf)
    return replace(shape_from_hf(hf, fam.name), first_dense_layers=fam.dense_first_layers(hf), mla=fam.mla)


def check_recipe_arch(recipe) -> None:
    """model.arch names a registered family, and agrees with model.path's config.json when one exists.

    The recipe schema (sao_megatron/core) cannot see this registry (core is the bottom layer), so the
    name is checked here, by `load_recipe` below, before anything starts.
    """
    from sao_megatron.core.config.errors import ConfigError

    name = recipe.model.arch
    if name not in ARCHS:
        raise ConfigError("model.arch", f"{name!r} is not a registered architecture",
                          f"use one of {', '.join(sorted(ARCHS))} (checkpoints/arch/)")
    cfg_path = Path(recipe.model.path) / "config.json" if recipe.model.path else None
    if cfg_path is None or not cfg_path.is_file():
        return
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return   # the recipe check already reports an unreadable config.json
    if model_type in BY_MODEL_TYPE and BY_MODEL_TYPE[model_type].name != name:
        raise ConfigError("model.arch", f"{name!r} but {cfg_path} has model_type {model_type!r} "
                          f"(family {BY_MODEL_TYPE[model_type].name!r})",
                          f"set model.arch = \"{BY_MODEL_TYPE[model_type].name}\"")


def load_recipe(path, overrides=(), check_files: bool = True):
    """The recipe loader of every command: core's load_recipe plus the architecture check above."""
    from sao_megatron.core.config import load_recipe as load_core_recipe

    recipe = load_core_recipe(path, list(overrides), check_files=check_files)
    check_recipe_arch(recipe)
    return recipe


def named_shapes() -> dict[str, dict]:
    """Every family's named full-size shapes (model.shape_preset), in registry order."""
    return {name: shape for f in FAMILIES for name, shape in f.shapes.items()}


__all__ = ["ARCHS", "BY_MODEL_TYPE", "FAMILIES", "ArchShape", "ArchSpec", "Family", "SpecError", "arch_shape",
           "check_recipe_arch", "family", "family_of_config", "load_recipe", "named_shapes", "spec_from_hf_config", "spec_from_hf_dir"]
