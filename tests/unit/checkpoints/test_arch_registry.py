"""The architecture registry (checkpoints/arch) is the one source of family facts: every family the recipe
accepts has a complete entry, model_type lookups round-trip, and every other table is derived from it."""
from __future__ import annotations

import pytest

from checkpoints import arch
from checkpoints.arch import ARCHS, BY_MODEL_TYPE, FAMILIES, SpecError
from sao_megatron.core.config import ConfigError


def _recipe_archs() -> tuple:
    return tuple(ARCHS)


def test_the_recipe_loader_accepts_every_registered_family_and_names_the_field_otherwise():
    for name in ARCHS:
        assert arch.load_recipe(None, [f"model.arch={name}", "model.path=nowhere"], check_files=False).model.arch == name
    with pytest.raises(ConfigError, match=r"^model.arch: 'llama' is not a registered architecture; fix: use one of deepseek_v3, glm4_moe"):
        arch.load_recipe(None, ["model.arch=llama", "model.path=nowhere"], check_files=False)


def test_a_family_registered_in_checkpoints_arch_alone_is_accepted_by_recipes(monkeypatch):
    """Adding a family touches checkpoints/arch only: the recipe schema in core lists no names."""
    from dataclasses import replace as dc_replace

    monkeypatch.setitem(ARCHS, "new_family", dc_replace(ARCHS["qwen3_moe"], name="new_family"))
    assert arch.load_recipe(None, ["model.arch=new_family", "model.path=nowhere"], check_files=False).model.arch == "new_family"


def test_model_arch_must_agree_with_the_model_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "glm4_moe"}')
    recipe = arch.load_recipe(None, ["model.arch=glm4_moe", "model.path=nowhere"], check_files=False)
    arch.check_recipe_arch(dc_model_path(recipe, tmp_path))
    with pytest.raises(ConfigError, match=r"model.arch: 'qwen3_moe' but .* has model_type 'glm4_moe'.*fix: set model.arch = \"glm4_moe\""):
        arch.check_recipe_arch(dc_model_path(arch.load_recipe(None, ["model.path=nowhere"], check_files=False), tmp_path))


def dc_model_path(recipe, path):
    recipe.model.path = str(path)
    return recipe


def test_every_command_loads_recipes_through_the_arch_check():
    """No command reads a recipe past the registry check (core's loader is for core and tests)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    offenders = [str(p.relative_to(root)) for d in ("sao_megatron", "launch", "parallel", "rollout", "bench")
                 for p in (root / d).rglob("*.py") if "core" not in p.parts
                 and re.search(r"from sao_megatron\.core\.config(\.recipe)? import [^\n]*\bload_recipe\b", p.read_text())]
    assert offenders == []


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
    with pytest.raises(ValueError, match=r"'llama' is not registered; fix: use one of \['deepseek_v3', 'glm4_moe', 'glm5', 'qwen3_moe'\]"):
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
