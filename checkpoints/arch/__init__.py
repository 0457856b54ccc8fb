"""Architecture registry: HF config.json -> ArchSpec, per family."""
from __future__ import annotations

import json
from pathlib import Path

from . import glm4_moe, glm5, qwen3_moe
from .spec import ArchSpec

ARCHS = {"qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe, "glm5": glm5}
# HF model_type -> our family name (the same table as parallel/specs.py).
MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "glm4_moe": "glm4_moe", "glm_moe_dsa": "glm5", "deepseek_v3": "glm5"}


def spec_from_hf_config(cfg: dict, arch: str = "") -> ArchSpec:
    """Build the ArchSpec; `arch` defaults to the config's model_type."""
    name = arch or MODEL_TYPES.get(cfg.get("model_type", ""), "")
    if name not in ARCHS:
        raise ValueError(f"architecture {name or cfg.get('model_type')!r} has no HF<->Megatron mapping; "
                         f"fix: use one of {sorted(ARCHS)}")
    return ARCHS[name].spec_from_hf_config(cfg)


def spec_from_hf_dir(path: str | Path, arch: str = "") -> ArchSpec:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found; fix: point at an HF model directory")
    return spec_from_hf_config(json.loads(cfg_path.read_text()), arch)


__all__ = ["ARCHS", "ArchSpec", "spec_from_hf_config", "spec_from_hf_dir"]
