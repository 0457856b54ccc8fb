"""One trainer rank for the error-agreement tests (test_rank_failures.py) and a stand-in policy.

`python agreement_ranks.py RUN_DIR STEPS FAULT` runs the real loop (`Trainer`), checkpoints and rollout
driver (rank 0, over a scripted engine) on the gloo group torch's env describes, with `FakePolicy` as
the model. FAULT is `none`, or `<where>@<step>:<rank>`: that rank raises in its step `<step>` (1-based),
`advantages` in the advantage computation (local: before the optimizer step, agreed), `update` inside
the policy's train_step before its gradient all-reduce (a collective region: cannot be agreed),
`collect` in rank 0's sample source (not a rollout failure: a bug; agreed through the batch broadcast). The rank
prints `error: <line>` and exits 1 on a fault, as `sao train`'s ranks do (entry.run_rank), and writes
what it trained to RUN_DIR/rank<r>.json.
"""
from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path

import torch

FAULT_TEXT = "injected fault in rank {rank}'s step {step}"


class FakePolicy:
    """RLModel's checkpoint and train_step surface: its state is every sample uid it trained on, in
    order; train_step all-reduces (the gradient sync DDP does) and then applies its 'optimizer step'."""

    def __init__(self, fail_in_update=None):
        self.state = {"updates": 0, "trained": []}
        self.fail_in_update = fail_in_update   # called first in train_step; may raise

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = copy.deepcopy(state)

    def train_step(self, batches, loss_fn) -> dict:
        if self.fail_in_update:
            self.fail_in_update()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(torch.ones(1))
        self.state["updates"] += 1
        self.state["trained"] += [uid for batch in batches for uid in batch.sample_uids]
        return {"loss": 0.0}

    def park(self) -> None:
        pass


def build_trainer(run_dir: Path, steps: int, rank: int, world: int, policy, name: str = "agree", before_batch=None):
    """The loop over a scripted engine (rank 0) and `policy`; returns (trainer, driver or None, collected
    batches: the uids of each batch rank 0 received, in order)."""
    from checkpoints.init_model import build_tokenizer
    from rollout.driver import RolloutDriver
    from rollout.prompts import build_prompt_source
    from rollout.rewards import resolve_reward_fn
    from rollout.engines.scripted import ScriptedEngine
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.checkpointing import Checkpoints
    from sao_megatron.trainer.components import Components
    from sao_megatron.trainer.loop import Trainer
    from sao_megatron.trainer.state import TrainerState
    from sao_megatron.trainer.weight_updates import NoWeightUpdates

    overrides = [f"run.output_dir='{run_dir}'", f"run.name='{name}'", f"run.num_steps={steps}",
                 "model.path='unused'", "algorithm.name='running_mean'", "algorithm.mini_batches=1",
                 "critic.warmup_steps=0", "checkpoint.interval=2", "rollout.task='arithmetic'",
                 "rollout.batch_size=4", "rollout.max_in_flight=4", "rollout.max_new_tokens=8",
                 "rollout.staleness_bound=100"]
    recipe = load_recipe(None, overrides, check_files=False)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    driver, collected = None, []
    if rank == 0:
        tok = build_tokenizer()
        cfg = recipe.rollout
        driver = RolloutDriver([ScriptedEngine("e0", token_time_s=0.0005)],
                               build_prompt_source(cfg, tok, seed=0, num_problems=256), resolve_reward_fn(cfg), cfg,
                               tok, seed=0, probe_interval_s=0.02)
        get_batch = driver.get_batch

        async def recording(*args, **kw):
            if before_batch:
                before_batch()
            batch = await get_batch(*args, **kw)
            collected.append([s.uid for s in batch])
            return batch

        driver.get_batch = recording
    checkpoints = Checkpoints(recipe, rank, world, saves=True)
    parts = Components(rank, world, policy, None, driver, NoWeightUpdates(), checkpoints, trains=True)
    return Trainer(recipe, parts, TrainerState()), driver, collected


def main(run_dir: str, steps: str, fault: str) -> int:
    from parallel.distributed import init_distributed
    from sao_megatron.trainer import steps as loop_steps
    from sao_megatron.trainer.agreement import RankFailed
    from sao_megatron.trainer.stopping import CollectionStopped

    env = init_distributed("gloo")
    where, at, who = (fault.replace("@", ":").split(":") + ["", "", ""])[:3] if fault != "none" else ("", "0", "-1")
    at, who = int(at), int(who)
    state_box = {}

    def inject():
        if env.rank == who and state_box["trainer"].state.step + 1 == at:
            raise RuntimeError(FAULT_TEXT.format(rank=env.rank, step=at))

    policy = FakePolicy(fail_in_update=inject if where == "update" else None)
    trainer, driver, collected = build_trainer(Path(run_dir), int(steps), env.rank, env.world_size, policy,
                                               before_batch=inject if where == "collect" else None)
    state_box["trainer"] = trainer
    if where == "advantages":
        real = loop_steps.compute_step_advantages

        def failing(*args):
            inject()
            return real(*args)

        loop_steps.compute_step_advantages = failing

    async def run():
        try:
            await trainer.train()
        finally:
            if driver is not None:
                await driver.stop()

    code = 0
    try:
        asyncio.run(run())
    except (CollectionStopped, RankFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        code = 1
    (Path(run_dir) / f"rank{env.rank}.json").write_text(json.dumps(
        {"collected": collected, "step": trainer.state.step, "policy": policy.state}))
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
