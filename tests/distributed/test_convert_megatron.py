"""Our HF -> Megatron shards loaded into a real Megatron-Core model (RLModel, CPU/gloo, 2 ranks) give the
HF model's logprobs, and the model's own state dicts merge back into the HF checkpoint bit-exactly.

Per layout (TP2, EP2, PP2) every rank: builds the policy, loads checkpoints.convert.hf_to_mcore shards
with load_state_dict (every parameter must be covered), computes logprobs on fixed micro-batches
(rank results compared with the HF forward: max |delta| < 1e-5 fp32), and sends its module state
dicts to rank 0, which merges them with mcore_to_hf and compares with the original tensors.
"""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}


def _rank_layout(model, spec):
    from megatron.core import parallel_state as ps

    from checkpoints.layout import ShardLayout
    from parallel.specs import padded_vocab_size

    d = model.dims
    return ShardLayout(tp_size=d.tp, tp_rank=ps.get_tensor_model_parallel_rank(), ep_size=d.ep,
                       ep_rank=ps.get_expert_model_parallel_rank(), pp_size=d.pp,
                       pp_rank=ps.get_pipeline_model_parallel_rank(), vpp_size=d.vpp,
                       padded_vocab_size=padded_vocab_size(spec.vocab_size, d.tp))


def _one_layout(model_dir: str, layout: dict) -> dict:
    import torch.distributed as dist

    from checkpoints.arch import spec_from_hf_dir
    from checkpoints.convert import hf_to_mcore, mcore_to_hf
    from checkpoints.hf_io import HFCheckpoint
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    spec, hf = spec_from_hf_dir(model_dir), HFCheckpoint(model_dir)
    model = RLModel.build(lc.make_recipe(model_dir, layout), "policy")
    mine = _rank_layout(model, spec)
    shards = hf_to_mcore(hf, spec, mine)
    uncovered = []
    for module, sd in zip(model.modules, shards):
        result = module.load_state_dict(sd, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        params = {n for n, _ in module.named_parameters()}
        uncovered += sorted(params & set(result.missing_keys))
    logprobs = [lp for lp, _ in model.compute_logprobs(lc.fixed_batches(spec.vocab_size, num=2, seq=12))]
    local = [{k: v for k, v in m.state_dict().items() if k in sd} for m, sd in zip(model.modules, shards)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, local))
    merged_equal = None
    if dist.get_rank() == 0:
        back = mcore_to_hf(dict(gathered), spec)
        merged_equal = sorted(k for k in hf if not torch.equal(back[k], hf[k])) if set(back) == set(hf) else ["<names differ>"]
    teardown_model_parallel()
    return {"uncovered": uncovered, "logprobs": logprobs, "merged_diff": merged_equal}


def _all_layouts(model_dir: str) -> dict:
    return {name: _one_layout(model_dir, layout) for name, layout in LAYOUTS.items()}


def _hf_logprobs(model_dir):
    import transformers

    from parallel import layout_check as lc

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for b in lc.fixed_batches(105, num=2, seq=12):
            logp = torch.log_softmax(model(b.tokens).logits.float(), -1)[:, :-1].gather(-1, b.tokens[:, 1:, None])[..., 0]
            out.append(logp)
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return run_distributed_test(_all_layouts, world_size=2, timeout_s=900, args=(str(tiny_model_dir),))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shards_cover_every_parameter(results, layout):
    assert results[0][layout]["uncovered"] == [] and results[1][layout]["uncovered"] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_state_merges_back_bit_exact(results, layout):
    assert results[0][layout]["merged_diff"] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_hf(results, tiny_model_dir, layout):
    ref = _hf_logprobs(tiny_model_dir)
    for rank in (0, 1):
        for ours, theirs in zip(results[rank][layout]["logprobs"], ref):
            # position t of ours predicts token t; HF's row t-1 predicts it. Padding positions are ignored.
            got = ours[:, 1:]
            valid = got != 0
            assert valid.sum() > 10 and (got - theirs).abs()[valid].max().item() < 1e-5
