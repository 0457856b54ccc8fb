"""ParallelDims: validated against the world and the model before any collective, one-line errors."""
from __future__ import annotations

import pytest

from sao_megatron.core.dims import LayoutError, ParallelDims
from sao_megatron.core.shape import ArchShape
from sao_megatron.core.config.schema import ParallelConfig

TINY = ArchShape(arch="qwen3_moe", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, num_experts=8,
                 top_k=2, vocab_size=105)


def test_world_size_mismatch_names_fields():
    with pytest.raises(LayoutError, match=r"tp\*cp\*pp\*dp = 2\*1\*1\*1 = 2 != world_size 4"):
        ParallelDims(tp=2).validate(4, TINY)


@pytest.mark.parametrize("dims, match", [
    (ParallelDims(tp=4, dp=1), "num_key_value_heads=2"),
    (ParallelDims(ep=3, dp=3), "does not divide num_experts=8"),
    (ParallelDims(pp=3), r"pp=3 \(vpp=1\) leaves a pipeline rank without layers \(num_layers=4: \[2, 2, 0\]\)"),
    (ParallelDims(pp=2, vpp=4), r"pp=2 \(vpp=4\) leaves a pipeline rank without layers \(num_layers=4"),
    (ParallelDims(ep=4, dp=2), "ep=4 x etp=1 does not divide"),
    (ParallelDims(vpp=2), "vpp > 1 needs parallel.pp > 1"),
])
def test_bad_layouts_fail_with_one_line(dims, match):
    with pytest.raises(LayoutError, match=match) as info:
        dims.validate(dims.world_size, TINY)
    assert "\n" not in str(info.value)


def test_sequence_parallel_forced_for_moe_with_tp():
    assert ParallelDims(tp=2).validate(2, TINY).sequence_parallel is True
    assert ParallelDims(tp=1, dp=2, sequence_parallel=True).validate(2, TINY).sequence_parallel is False


def test_expert_tp_defaults_to_tp():
    dims = ParallelDims(tp=2, ep=2, dp=2).validate(4, TINY)
    assert dims.etp is None and dims.expert_tp == 2


def test_from_config_resolves_dp_and_etp():
    dims = ParallelDims.from_config(ParallelConfig(tp=2, ep=2, etp=0, dp=0), world_size=4)
    assert (dims.tp, dims.dp, dims.ep, dims.etp) == (2, 2, 2, None)


def test_tp_ep_pp_layouts_of_four_ranks_valid():
    for dims in (ParallelDims(tp=2, pp=2), ParallelDims(tp=2, ep=2, dp=2), ParallelDims(pp=2, vpp=2, dp=2),
                 ParallelDims(ep=4, dp=4)):
        assert dims.validate(4, TINY).world_size == 4
