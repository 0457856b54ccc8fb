"""`Family`: everything the project knows about one architecture family, in one record.

Each family module (qwen3_moe.py, glm4_moe.py, glm5.py) defines one `FAMILY`; checkpoints/arch/__init__.py
lists them and answers every lookup (by recipe `model.arch` name or by HF `model_type`). The users:

| field            | read by                                                   | what for |
|------------------|-----------------------------------------------------------|----------|
| model_types      | arch.family_of_config                                     | config.json model_type -> this family |
| hf_*_class       | tiny_models.build_tiny_model (init-model, fixtures)       | transformers classes |
| spec             | name_map / convert / parallel.hf_mapping / sao convert    | ArchSpec: which optional tensors exist |
| megatron         | parallel/specs.transformer_config                         | TransformerConfig kwargs of this family |
| mla              | parallel/specs.transformer_config                         | MLATransformerConfig, TE layer spec only |
| rotary           | parallel/specs.rotary_kwargs                              | GPTModel's RoPE arguments |
| dense_first_layers | arch.arch_shape (ParallelDims.validate, layout_check)   | dense layers first |
| qk_norm          | spec, parallel/model_shapes (planner counts)              | per-head q/k RMSNorm present |
| shapes           | parallel/model_shapes.SHAPES (`sao plan`)                 | full-size HF configs |
| presets          | checkpoints/init_model (`sao init-model --preset`)        | config kwargs |

The module imports neither torch nor transformers, so the CLI can list families cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .spec import ArchSpec


class SpecError(ValueError):
    """An HF config the Megatron side cannot map; the message names the key."""


@dataclass(frozen=True)
class Family:
    name: str                                   # recipe model.arch, `sao init-model --arch`
    model_types: tuple                          # HF config.json model_type values read as this family
    hf_config_class: str                        # transformers configuration class of model_types[0]
    hf_model_class: str                         # transformers causal-LM class of model_types[0]
    spec: Callable[[dict], ArchSpec]            # HF config -> ArchSpec (drives the name map)
    megatron: Callable[[Mapping[str, Any]], dict]  # TransformerConfig kwargs beyond parallel/specs' common ones
    rotary: Callable[[Mapping[str, Any]], dict]    # GPTModel RoPE kwargs
    dense_first_layers: Callable[[Mapping[str, Any]], int]
    qk_norm: Callable[[Mapping[str, Any]], bool]
    shapes: Mapping[str, dict]                  # named full-size HF configs (model.shape_preset)
    presets: Mapping[str, dict]                 # init-model presets: transformers config kwargs, no token ids
    mla: bool = False                           # multi-latent attention (MLATransformerConfig, needs TE)

    def missing_fields(self) -> list[str]:
        """Names of fields left empty (tests/unit/checkpoints/test_arch_registry.py requires none)."""
        return [name for name, value in vars(self).items()
                if name != "mla" and (value is None or value == "" or (hasattr(value, "__len__") and not len(value)))]


def hf_get(hf: Mapping[str, Any], *keys, default=None):
    """First present key of an HF config for the Megatron side; a missing one is a SpecError naming it."""
    for key in keys:
        if key in hf and hf[key] is not None:
            return hf[key]
    if default is None:
        raise SpecError(f"config.json lacks {keys[0]!r}")
    return default
