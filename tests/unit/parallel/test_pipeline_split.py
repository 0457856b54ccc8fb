"""The one layer split (sao_megatron/core/dims.py) places every layer where Megatron-Core 0.16.1 builds
it: get_transformer_layer_offset and get_num_layers_to_build on a TransformerConfig carrying
num_layers_in_last_pipeline_stage, over even, uneven and interleaved (vpp) layouts; and the recipe
check, the planner and `sao convert` accept the same layouts and refuse the same ones."""
from __future__ import annotations

import pytest

from sao_megatron.core.dims import LayoutError, ParallelDims, layer_range, stage_layer_counts
from sao_megatron.core.shape import ArchShape

# (num_layers, pp, vpp, last_stage_layers): even, automatic uneven, explicit uneven, interleaved uneven
def _shape(layers: int) -> ArchShape:
    return ArchShape(arch="qwen3_moe", num_layers=layers, hidden_size=8, num_heads=8, num_kv_heads=8, num_experts=8,
                     top_k=2, vocab_size=32)


GRID = [(4, 2, 1, 0), (8, 2, 2, 0), (78, 4, 1, 0), (61, 4, 1, 0), (4, 2, 1, 1), (4, 2, 1, 3), (6, 3, 1, 2),
        (6, 2, 2, 0), (30, 4, 2, 0), (92, 8, 1, 1), (94, 4, 1, 0), (10, 3, 2, 2)]


def _megatron_config(layers: int, pp: int, vpp: int, last: int):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = ParallelDims(pp=pp, vpp=vpp, last_stage_layers=last)
    return TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
                             num_layers_in_last_pipeline_stage=dims.megatron_last_stage_layers(layers))


@pytest.mark.parametrize("layers,pp,vpp,last", GRID)
def test_layer_ranges_are_megatrons(layers, pp, vpp, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    ParallelDims(pp=pp, vpp=vpp, last_stage_layers=last, dp=1).validate(pp, _shape(layers))
    config = _megatron_config(layers, pp, vpp, last)
    seen = []
    for rank in range(pp):
        for v in range(vpp):
            stage = v if vpp > 1 else None
            ours = layer_range(layers, pp, vpp, rank, v, last)
            assert ours.start == get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank), (rank, v)
            assert len(ours) == get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank), (rank, v)
            seen += list(ours)
    assert sorted(seen) == list(range(layers))


def test_the_automatic_split_and_the_glm5_recipe_split():
    assert stage_layer_counts(78, 4) == [20, 20, 20, 18]          # GLM-5 over pp=4
    assert stage_layer_counts(80, 4) == [20, 20, 20, 20]
    assert stage_layer_counts(6, 2, vpp=2) == [4, 2]               # 3 per rank would not split over vpp=2
    assert stage_layer_counts(4, 2, last_stage_layers=1) == [3, 1]
    assert ParallelDims(pp=4).megatron_last_stage_layers(80) is None
    assert ParallelDims(pp=4).megatron_last_stage_layers(78) == 18


@pytest.mark.parametrize("layers,dims,field,part", [
    (6, dict(pp=4), "parallel.pp", "leaves a pipeline rank without layers"),
    (4, dict(pp=2, last_stage_layers=4), "parallel.last_stage_layers", "not within 1..3"),
    (5, dict(pp=3, last_stage_layers=2), "parallel.last_stage_layers", "cannot split the remaining 3"),
    (4, dict(pp=1, last_stage_layers=1), "parallel.last_stage_layers", "set with pp=1"),
    (8, dict(pp=2, vpp=2, last_stage_layers=3), "parallel.vpp", "does not divide the layers"),
])
def test_impossible_splits_name_the_field(layers, dims, field, part):
    world = dims.get("pp", 1)
    with pytest.raises(LayoutError, match=rf"^{field}: .*{part}.*; fix: "):
        ParallelDims(dp=1, **dims).validate(world, _shape(layers))


def test_recipe_planner_and_convert_agree_on_an_uneven_layout(tiny_model_dir):
    """The recipe check, the planner and the converter all take pp=2 with 3+1 layers and all refuse pp=3."""
    import json

    from checkpoints.arch import load_recipe
    from checkpoints.layout import ShardLayout
    from parallel.planner import Layout, layout_problem

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", "parallel.pp=2", "parallel.last_stage_layers=1"])
    assert recipe.parallel.last_stage_layers == 1
    assert layout_problem(hf, Layout(pp=2, last_stage_layers=1), 2) == ""
    assert ShardLayout(pp_size=2, pp_rank=1, last_stage_layers=1).layer_range(4) == range(3, 4)
    with pytest.raises(Exception, match="parallel.last_stage_layers"):
        load_recipe(None, [f"model.path='{tiny_model_dir}'", "parallel.pp=3", "parallel.last_stage_layers=1"])
    assert "parallel.last_stage_layers" in layout_problem(hf, Layout(pp=3, last_stage_layers=1), 3)
