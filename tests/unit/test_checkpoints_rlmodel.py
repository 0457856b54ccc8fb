"""Run checkpoint of the real Megatron policy (RLModel on one gloo rank, Adam state included): a run
interrupted after step 2 and resumed from its checkpoint into a freshly built model gives the same
losses and grad norms at steps 3-4 as an uninterrupted run, bit for bit."""
from __future__ import annotations

from parallel.distributed import run_distributed_test


def _steps(model, batches, n: int) -> list[dict]:
    from parallel import layout_check as lc

    return [model.train_step(batches[i % 2 * 2:i % 2 * 2 + 2], lc.policy_gradient_loss) for i in range(n)]


def _scenario(model_dir: str, ckpt_root: str) -> dict:
    from safetensors.torch import load_file

    from checkpoints.run_state import RngState, RunCheckpointer
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=4, seq=12)

    def fresh():
        teardown_model_parallel()
        model = RLModel.build(lc.make_recipe(model_dir, {}, lr=1e-2), "policy")
        model.load_hf_state_dict(hf)
        return model

    full = _steps(fresh(), batches, 4)
    first = fresh()
    _steps(first, batches, 2)
    RunCheckpointer(ckpt_root).save(2, {"policy": first, "rng": RngState()})
    second = fresh()                                   # new weights and a new optimizer ...
    RunCheckpointer(ckpt_root).load({"policy": second, "rng": RngState()})   # ... restored from disk
    resumed = _steps(second, batches, 2)               # steps 3, 4 use batches 0-1, 2-3 as in the full run
    teardown_model_parallel()
    return {"full": full[2:], "resumed": resumed}


def test_rlmodel_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    out = run_distributed_test(_scenario, world_size=1, timeout_s=600, args=(str(tiny_model_dir), str(tmp_path)))[0]
    keys = ("loss", "grad_norm")
    assert all(k in out["full"][0] for k in keys)
    assert [[m[k] for k in keys] for m in out["resumed"]] == [[m[k] for k in keys] for m in out["full"]]
    assert out["full"][0]["loss"] != out["full"][1]["loss"]
