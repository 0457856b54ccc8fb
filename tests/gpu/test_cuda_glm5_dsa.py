"""The flagship's class on CUDA (the GPU check kit): tiny GLM-5 (MLA + DSA, index_topk 4 < the sequence, a
shared indexer layer) scored by the reference server's ModelRunner on the GPU, which returns the routes
and the indexer selections it took; the trainer (RLModel, one nccl rank, our MLA/DSA core attention in
every layer, Transformer Engine's spec elsewhere when it is installed) replays both.

Stated tolerances, fp32 on both sides: max |trainer - server| < 2e-4 (same math, other kernels), and
indexer_agreement >= 0.99 after a training step on those selections (the trainer's own indexer picks
what the server picked, up to near-ties). CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.gpu

SEQ = 16


def server_scores(model_dir: str, batches) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per batch: (logprobs [rows, seq], routes [rows, seq, L, k], indexer_topk [rows, seq, L, topk]) as the
    reference server's model computes them on CUDA; -1 past each length."""
    from rollout.engines.reference_server.model_runner import ModelRunner

    runner = ModelRunner(model_dir, dtype="fp32", device="cuda")
    out = []
    for batch in batches:
        rows, seq = batch.tokens.shape
        logp, routes, chosen = torch.zeros(rows, seq), None, None
        for b in range(rows):
            n = int(batch.lengths[b])
            tokens = batch.tokens[b, :n].tolist()
            scored = runner.score(tokens)
            logp[b, 1:n] = torch.log_softmax(scored.logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            if routes is None:
                routes = torch.full((rows, seq, *scored.routes.shape[1:]), -1, dtype=torch.int32)
                chosen = torch.full((rows, seq, *scored.indexer_topk.shape[1:]), -1, dtype=torch.int32)
            routes[b, :n] = scored.routes
            chosen[b, :n] = scored.indexer_topk
        out.append((logp, routes, chosen))
    del runner
    return out


def trainer_run(model_dir: str, batches) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    teardown_model_parallel()
    model = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    logps = [logp.float().cpu() for logp, _ in model.compute_logprobs(batches)]
    metrics = model.train_step(batches, lc.policy_gradient_loss)
    teardown_model_parallel()
    return {"logps": logps, "indexer_agreement": metrics["indexer_agreement"],
            "route_agreement": metrics["route_agreement"]}


def test_glm5_trainer_replays_the_cuda_servers_routes_and_selections(tmp_path):
    from checkpoints.tiny_models import make_tiny_hf
    from parallel import layout_check as lc

    model_dir = str(make_tiny_hf(tmp_path / "glm5", "glm5", seed=1))
    batches = lc.fixed_batches(105, num=2, seq=SEQ)
    scored = server_scores(model_dir, batches)
    replayed = [replace(b, routed_experts=r, indexer_topk=i) for b, (_, r, i) in zip(batches, scored)]
    ours = run_distributed_test(trainer_run, world_size=1, backend="nccl", timeout_s=600, args=(model_dir, replayed))[0]
    for batch, mine, (theirs, _, _) in zip(batches, ours["logps"], scored):
        pos = torch.arange(SEQ)[None, :]
        real = (pos >= 1) & (pos < batch.lengths[:, None])
        assert (mine - theirs).abs()[real].max().item() < 2e-4
    assert ours["indexer_agreement"] >= 0.99 and ours["route_agreement"] >= 0.99
