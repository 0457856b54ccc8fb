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

from . import glm4_moe, glm5, qwen3_moe
from .family import Family, SpecError
from .spec import ArchSpec

FAMILIES: tuple[Family, ...] = (qwen3_moe.FAMILY, glm4_moe.FAMILY, glm5.FAMILY)
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


def named_shapes() -> dict[str, dict]:
    """Every family's named full-size shapes (model.shape_preset), in registry order."""
    return {name: shape for f in FAMILIES for name, shape in f.shapes.items()}


__all__ = ["ARCHS", "BY_MODEL_TYPE", "FAMILIES", "ArchShape", "ArchSpec", "Family", "SpecError", "arch_shape",
           "family", "family_of_config", "named_shapes", "spec_from_hf_config", "spec_from_hf_dir"]
