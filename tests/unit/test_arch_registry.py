"""The architecture registry (checkpoints/arch) is the one source of family facts: every family the recipe
accepts has a complete entry, model_type lookups round-trip, and every other table is derived from it."""
from __future__ import annotations

import typing

import pytest

from checkpoints import arch
from checkpoints.arch import ARCHS, BY_MODEL_TYPE, FAMILIES, SpecError
from sao_megatron.core.config.schema import ModelConfig


def _recipe_archs() -> tuple:
    return typing.get_args(typing.get_type_hints(ModelConfig)["arch"])


def test_recipe_arch_literal_and_registry_name_the_same_families():
    assert set(_recipe_archs()) == set(ARCHS)


@pytest.mark.parametrize("name", _recipe_archs())
def test_every_field_of_every_entry_is_filled(name):
    fam = ARCHS[name]
    assert fam.name == name and fam.missing_fields() == []
    assert "tiny" in fam.presets   # init-model and the conversion tests build it


def test_model_type_lookups_round_trip():
    for fam in FAMILIES:
        for model_type in fam.model_types:
            assert arch.family_of_config({"model_type": model_type}) is fam
    assert sum(len(f.model_types) for f in FAMILIES) == len(BY_MODEL_TYPE)   # no model_type claimed twice
    with pytest.raises(SpecError, match=r"model_type 'llama' is not supported; use one of \['deepseek_v3'"):
        arch.family_of_config({"model_type": "llama"})


@pytest.mark.parametrize("name", _recipe_archs())
def test_named_shapes_belong_to_their_family(name):
    from parallel.specs import arch_of

    fam = ARCHS[name]
    for shape_name, shape in fam.shapes.items():
        assert arch_of(shape) == name, shape_name
        assert arch.spec_from_hf_config(shape).arch == name
        assert arch.arch_shape(shape).num_moe_layers == len(fam.spec(shape).moe_layers)


@pytest.mark.parametrize("name", _recipe_archs())
def test_transformers_classes_exist_and_match_the_first_model_type(name):
    import transformers

    fam = ARCHS[name]
    config_cls, model_cls = getattr(transformers, fam.hf_config_class), getattr(transformers, fam.hf_model_class)
    assert config_cls.model_type == fam.model_types[0] and model_cls.config_class is config_cls


def test_derived_tables_are_the_registry():
    from checkpoints.init_model import PRESETS
    from parallel import model_shapes
    from sao_megatron.cli.main import build_parser

    assert set(model_shapes.SHAPES) == {n for f in FAMILIES for n in f.shapes}
    assert sum(len(f.shapes) for f in FAMILIES) == len(model_shapes.SHAPES)   # no shape name claimed twice
    assert PRESETS == {(f.name, p): kw for f in FAMILIES for p, kw in f.presets.items()}
    sub = next(a for a in build_parser()._actions if a.choices and "init-model" in a.choices)
    arch_action = next(a for a in sub.choices["init-model"]._actions if a.dest == "arch")
    assert list(arch_action.choices) == list(ARCHS)


def test_unknown_family_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'llama' is not registered; fix: use one of \['glm4_moe', 'glm5', 'qwen3_moe'\]"):
        arch.family("llama")


@pytest.mark.parametrize("name", _recipe_archs())
def test_megatron_config_kind_follows_the_entry(name):
    from parallel import specs
    from sao_megatron.core.dims import ParallelDims

    fam = ARCHS[name]
    shape = next(iter(fam.shapes.values()))
    cfg = specs.transformer_config(shape, ParallelDims())
    assert bool(getattr(cfg, "multi_latent_attention", False)) == fam.mla
    assert cfg.qk_layernorm == (fam.qk_norm(shape) or fam.mla)   # MLA: latent norms
