"""One copy of the layout rules: the recipe check, the planner and ParallelDims give the same verdict
and the same message for the same (layout, model) case, including the cases where they used to differ."""
from __future__ import annotations

import pytest

from parallel.planner import Layout, layout_problem
from sao_megatron.core.config import ConfigError, Recipe
from sao_megatron.core.config.recipe import check_model_fits_layout
from sao_megatron.core.config.schema import ParallelConfig
from sao_megatron.core.dims import LayoutError, ParallelDims
from sao_megatron.core.shape import shape_from_hf

GQA = {"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 8, "num_hidden_layers": 8}
MLA = {"num_attention_heads": 64, "num_key_value_heads": 2, "kv_lora_rank": 512, "n_routed_experts": 8,
       "num_hidden_layers": 8}   # an MLA config whose num_key_value_heads tp does not divide
BOTH_KEYS = {"num_attention_heads": 4, "n_routed_experts": 8, "num_experts": 6, "num_hidden_layers": 4}
DENSE = {"num_attention_heads": 4, "num_hidden_layers": 4}

CASES = [  # (hf, layout sizes, world, field or '' when valid, message part)
    (GQA, dict(tp=8), 8, "parallel.tp", "num_key_value_heads=4 kv heads"),
    (GQA, dict(tp=4, ep=8), 32, "", ""),
    (GQA, dict(tp=3), 3, "parallel.tp", "does not divide 32 attention heads"),
    (GQA, dict(ep=3), 3, "parallel.ep", "ep=3 does not divide num_experts=8 routed experts"),
    (GQA, dict(ep=16), 8, "parallel.ep", "ep=16 x etp=1 does not divide the 8 ranks of a stage"),
    (GQA, dict(tp=2, pp=2), 6, "parallel.world_size", "6 is not divisible by tp*pp*cp = 4"),
    (GQA, dict(pp=2, vpp=2), 4, "", ""),                     # layers: see the uneven-last-stage test
    (MLA, dict(tp=8, ep=8), 8, "", ""),                      # was rejected by the recipe check only
    (BOTH_KEYS, dict(ep=4), 4, "", ""),                      # routed experts: n_routed_experts first
    (DENSE, dict(ep=2), 2, "parallel.ep", "ep=2 but the model has no experts"),
]


def _recipe_verdict(hf: dict, sizes: dict, world: int) -> str:
    recipe = Recipe()
    recipe.parallel = ParallelConfig(world_size=world, etp=sizes.get("etp", 1), **{k: v for k, v in sizes.items() if k != "etp"})
    try:
        recipe._check_parallel()
        check_model_fits_layout(recipe, hf)
    except ConfigError as err:
        return str(err)
    return ""


def _dims_verdict(hf: dict, sizes: dict, world: int) -> str:
    try:
        ParallelDims(dp=0, **{"etp": 1, **sizes}).validate(world, shape_from_hf(hf))
    except LayoutError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("hf, sizes, world, field, part", CASES)
def test_recipe_planner_and_dims_agree(hf, sizes, world, field, part):
    verdicts = {"recipe": _recipe_verdict(hf, sizes, world), "planner": layout_problem(hf, Layout(**sizes), world),
                "dims": _dims_verdict(hf, sizes, world)}
    assert len(set(verdicts.values())) == 1, verdicts
    verdict = verdicts["dims"]
    if not field:
        assert verdict == ""
    else:
        assert verdict.startswith(f"{field}: ") and part in verdict and "; fix: " in verdict


def test_mla_skips_the_kv_head_rule_but_not_the_head_rule():
    assert _dims_verdict(MLA, dict(tp=8, ep=8), 8) == ""
    assert "attention heads" in _dims_verdict(MLA, dict(tp=128, ep=1), 128)
    gqa_like = {**MLA, "kv_lora_rank": 0}
    assert "kv heads" in _dims_verdict(gqa_like, dict(tp=8, ep=8), 8)


def test_recipe_and_planner_both_take_megatrons_uneven_last_stage():
    """78 layers over pp=4 (GLM-5): 20,20,20,18, Megatron's num_layers_in_last_pipeline_stage, which the
    trainer configures (parallel/specs.py); the recipe and the planner give the same verdicts."""
    hf = {"num_attention_heads": 64, "n_routed_experts": 256, "num_hidden_layers": 78, "kv_lora_rank": 512}
    assert layout_problem(hf, Layout(pp=4), 4) == ""
    assert _recipe_verdict(hf, dict(pp=4), 4) == _dims_verdict(hf, dict(pp=4), 4) == ""
    six = {**hf, "num_hidden_layers": 6}
    assert "leaves a pipeline rank without layers" in layout_problem(six, Layout(pp=4), 4)
    assert _recipe_verdict(six, dict(pp=4), 4) == _dims_verdict(six, dict(pp=4), 4) != ""


def test_resolved_dp_and_planner_accessors():
    dims = Layout(tp=2, pp=2, ep=4).validate(16, shape_from_hf(GQA))
    assert dims.dp == 4 and dims.data_parallel(16) == 4 and dims.expert_data_parallel(16) == 2
    assert Layout(tp=4, pp=2, ep=8, etp=2, vpp=2).short() == "tp4 pp2 cp1 ep8 etp2 vpp2"
