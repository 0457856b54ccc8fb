"""Run checkpoint of the real Megatron policy (RLModel on one gloo rank, Adam state included): a run
interrupted after step 2 and resumed from its checkpoint into a freshly built model gives the same
losses and grad norms at steps 3-4 as an uninterrupted run, bit for bit."""
from __future__ import annotations

import pytest

from parallel.distributed import run_distributed_test


def _steps(model, batches, n: int) -> list[dict]:
    from parallel import layout_check as lc

    return [model.train_step(batches[i % 2 * 2:i % 2 * 2 + 2], lc.policy_gradient_loss) for i in range(n)]


def _scenario(model_dir: str, ckpt_root: str, fmt: str = "distributed", at: int = 2) -> dict:
    from safetensors.torch import load_file

    from checkpoints.run_state import RngState, RunCheckpointer
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    assert at % 2 == 0, "the batches alternate: save after an even number of steps"
    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=4, seq=12)

    def fresh():
        teardown_model_parallel()
        recipe = lc.make_recipe(model_dir, {}, lr=1e-2)
        recipe.checkpoint.format = fmt
        model = RLModel.build(recipe, "policy")
        model.load_hf_state_dict(hf)
        return model

    full = _steps(fresh(), batches, 4)
    first = fresh()
    _steps(first, batches, at)
    RunCheckpointer(ckpt_root).save(max(at, 1), {"policy": first, "rng": RngState()})
    second = fresh()                                   # new weights and a new optimizer ...
    RunCheckpointer(ckpt_root).load({"policy": second, "rng": RngState()})   # ... restored from disk
    resumed = _steps(second, batches, 4 - at)          # steps at+1.. use the batches the full run used
    teardown_model_parallel()
    return {"full": full[at:], "resumed": resumed}


@pytest.mark.parametrize("fmt,at", [("distributed", 2), ("per_rank", 2), ("distributed", 0), ("per_rank", 0)],
                         ids=["distributed", "per_rank", "distributed-before-first-step", "per_rank-before-first-step"])
def test_rlmodel_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path, fmt, at):
    """at = 0: saved before the policy's first optimizer step (as while the critic warms up), when Adam
    has no moments yet; the resume must load the weights and start Adam afresh, as the run would have."""
    out = run_distributed_test(_scenario, world_size=1, timeout_s=600,
                               args=(str(tiny_model_dir), str(tmp_path), fmt, at))[0]
    keys = ("loss", "grad_norm")
    assert all(k in out["full"][0] for k in keys)
    assert [[m[k] for k in keys] for m in out["resumed"]] == [[m[k] for k in keys] for m in out["full"]]
    assert out["full"][0]["loss"] != out["full"][1]["loss"]


def _save_after_steps(model_dir: str, ckpt_root: str) -> None:
    from safetensors.torch import load_file

    from checkpoints.run_state import RunCheckpointer
    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    model = RLModel.build(lc.make_recipe(model_dir, {}, lr=1e-2), "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    _steps(model, lc.fixed_batches(105, num=4, seq=12), 2)
    RunCheckpointer(ckpt_root).save(2, {"policy": model})


def _resume_under(model_dir: str, ckpt_root: str, layout: dict) -> list[dict]:
    from checkpoints.run_state import RunCheckpointer
    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    model = RLModel.build(lc.make_recipe(model_dir, layout, lr=1e-2), "policy")
    RunCheckpointer(ckpt_root).load({"policy": model})   # weights and Adam state, resharded
    batches = lc.fixed_batches(105, num=4, seq=12)
    if layout.get("dp", 1) > 1:
        return [model.train_step(lc.dp_shard(batches[i * 2:i * 2 + 2]), lc.policy_gradient_loss) for i in range(2)]
    return _steps(model, batches, 2)


@pytest.fixture(scope="module")
def saved_single_rank(tiny_model_dir, tmp_path_factory):
    """(uninterrupted steps 3-4 on one rank, a distributed checkpoint after step 2 on one rank)."""
    tmp = tmp_path_factory.mktemp("reshard")
    full = run_distributed_test(_scenario, world_size=1, timeout_s=600,
                                args=(str(tiny_model_dir), str(tmp / "ref")))[0]["full"]
    run_distributed_test(_save_after_steps, world_size=1, timeout_s=600, args=(str(tiny_model_dir), str(tmp / "c")))
    return full, tmp / "c"


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_distributed_checkpoint_resumes_under_another_layout(tiny_model_dir, saved_single_rank, layout):
    """Saved by one rank after 2 steps, resumed by 2 ranks under TP2 / PP2 (weights and Adam state
    resharded): steps 3-4 give the uninterrupted single-rank run's losses and grad norms (to the
    layouts' reduction-order tolerance)."""
    full, ckpt = saved_single_rank
    resumed = run_distributed_test(_resume_under, world_size=2, timeout_s=600,
                                   args=(str(tiny_model_dir), str(ckpt), layout))[0]
    for got, want in zip(resumed, full):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_switching_expert_parallelism_on_resume_is_a_one_line_error(tiny_model_dir, saved_single_rank):
    from parallel.distributed import DistributedTestError

    _, ckpt = saved_single_rank
    with pytest.raises(DistributedTestError, match=r"holds an optimizer of 1 part\(s\) \(saved with ep=1\), this run "
                                                   r"builds 2 \(ep=2\); fix: resume with expert parallelism"):
        run_distributed_test(_resume_under, world_size=2, timeout_s=600, args=(str(tiny_model_dir), str(ckpt), {"ep": 2}))
