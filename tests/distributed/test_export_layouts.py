"""`sao export` of a run checkpoint written by 2 ranks under TP2 or EP2 (distributed format: exported on one
process; per_rank: exported by 2 ranks rebuilding TP2): the policy export is the 2-rank trainer's own
export_hf, bit for bit; the critic export loads as AutoModelForTokenClassification and gives the
trainer's values; --fp8 writes what `sao convert hf-to-fp8` writes from the bf16 export."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.distributed import run_distributed_test


def _save_run(model_dir: str, run_dir: str, layout: dict, fmt: str) -> dict:
    """Policy and critic of the tiny model under `layout`, one update each, saved as a run checkpoint."""
    import dataclasses

    from safetensors.torch import load_file

    from checkpoints.run_state import RunCheckpointer
    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.core.config import load_recipe

    # one file per rank: two ranks writing the same file let one read it half written (model.path empty)
    source = Path(run_dir).parent / f"recipe-rank{torch.distributed.get_rank()}.toml"
    source.write_text(f'[run]\nname = "{Path(run_dir).name}"\noutput_dir = "{Path(run_dir).parent}"\n'
                      f'[model]\npath = "{model_dir}"\n[algorithm]\nlr = 1e-2\n[critic]\nlr = 1e-2\n'
                      f'[checkpoint]\nformat = "{fmt}"\n')
    recipe = load_recipe(source)
    recipe = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, **layout))
    if torch.distributed.get_rank() == 0:
        recipe.dump(Path(run_dir))
    hf = load_file(f"{model_dir}/model.safetensors")
    policy, critic = RLModel.build(recipe, "policy"), RLModel.build(recipe, "critic")
    policy.load_hf_state_dict(hf)
    critic.load_hf_state_dict(hf)
    batches = [dataclasses.replace(b, returns=b.loss_mask.clone())   # returns 1: the value head moves off 0
               for b in lc.fixed_batches(105, num=2, seq=12)]
    mine = lc.dp_shard(batches) if layout.get("ep", 1) > 1 else batches   # EP2 on 2 ranks is DP2
    policy.train_step(mine, lc.policy_gradient_loss)
    critic.train_step(mine, lc.value_loss)
    RunCheckpointer(Path(run_dir) / "checkpoints").save(1, {"policy": policy, "critic": critic})
    return {"policy": {k: v.clone() for k, v in policy.export_hf()},
            "values": critic.compute_values(batches), "tokens": [b.tokens for b in batches]}


def _export(run_dir: str, fp8: bool) -> list[int]:
    from sao_megatron.cli.main import main

    ckpt = f"{run_dir}/checkpoints/latest"
    codes = [main(["export", ckpt, f"{run_dir}/policy"]), main(["export", ckpt, f"{run_dir}/critic", "--role", "critic"])]
    if fp8:
        codes.append(main(["export", ckpt, f"{run_dir}/policy_fp8", "--fp8"]))
    return codes


def _tensors(path: Path) -> dict:
    from checkpoints.hf_io import HFCheckpoint

    return dict(HFCheckpoint(path).items())


@pytest.mark.parametrize("layout, fmt", [({"tp": 2}, "distributed"), ({"ep": 2}, "distributed"), ({"tp": 2}, "per_rank")],
                         ids=["tp2", "ep2", "tp2-per-rank"])
def test_export_of_a_two_rank_checkpoint(tiny_model_dir, tmp_path, layout, fmt):
    from transformers import AutoModelForTokenClassification

    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    saved = run_distributed_test(_save_run, world_size=2, timeout_s=600,
                                 args=(str(tiny_model_dir), str(run_dir), layout, fmt))[0]
    fp8 = layout == {"tp": 2} and fmt == "distributed"
    codes = run_distributed_test(_export, world_size=1, timeout_s=600, args=(str(run_dir), fp8))[0]
    assert codes == [0] * len(codes)

    policy = _tensors(run_dir / "policy")
    assert sorted(policy) == sorted(saved["policy"])
    assert all(torch.equal(policy[k], saved["policy"][k]) for k in policy)

    critic = AutoModelForTokenClassification.from_pretrained(run_dir / "critic").eval()
    assert critic.score.weight.abs().sum() > 0   # the value head trained, and it is the one loaded
    for tokens, values in zip(saved["tokens"], saved["values"]):
        with torch.no_grad():
            raw = critic(tokens).logits[..., 0].float()
        assert torch.allclose(raw[:, :-1], values[:, 1:], atol=1e-4), (raw[:, :-1] - values[:, 1:]).abs().max()

    if fp8:
        from rollout.weights.fp8_checkpoint import write_block_fp8_checkpoint

        reference = write_block_fp8_checkpoint(run_dir / "policy", tmp_path / "converted")
        ours, theirs = _tensors(run_dir / "policy_fp8"), _tensors(reference)
        assert sorted(ours) == sorted(theirs) and any(t.dtype == torch.float8_e4m3fn for t in ours.values())
        assert all(torch.equal(ours[k].view(torch.uint8) if ours[k].dtype == torch.float8_e4m3fn else ours[k],
                               theirs[k].view(torch.uint8) if theirs[k].dtype == torch.float8_e4m3fn else theirs[k])
                   for k in ours)
        config = json.loads((run_dir / "policy_fp8" / "config.json").read_text())
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
