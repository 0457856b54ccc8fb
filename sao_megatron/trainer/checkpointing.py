"""Run checkpoints from the loop's side: what a checkpoint holds, when one is due, and the resume."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from sao_megatron.core.config import ConfigError, Recipe


class Checkpoints:
    """Saves every checkpoint.interval steps, at the last step and on a preemption signal (never in the
    debug modes: `saves` False); resumes per checkpoint.resume. Components go by name: policy, critic,
    driver (the sample source, rank 0), trainer (TrainerState), rng."""

    def __init__(self, recipe: Recipe, rank: int, world_size: int, saves: bool):
        from checkpoints.preemption import install_preemption_handlers
        from checkpoints.run_state import RunCheckpointer

        if recipe.checkpoint.save_on_signal:
            install_preemption_handlers()
        self.cfg, self.world_size, self.saves = recipe.checkpoint, world_size, saves
        self.checkpointer = RunCheckpointer(recipe.run_dir / "checkpoints", keep_last=self.cfg.keep_last,
                                            rank=rank, world_size=world_size)
        self.hf_root, self.model_path = recipe.run_dir / "hf", recipe.model.path   # checkpoint.hf_every exports

        self.verified: Optional[dict] = None   # resolve_resume's verified top manifest (set by entry.run_rank)

    async def maybe_save(self, step: int, final: bool, parts: dict) -> None:
        """Save when `final` (the last step, a preemption the ranks agreed on, a stop) or at the interval."""
        due = final or (self.cfg.interval and step % self.cfg.interval == 0)
        if due and self.saves:
            self.checkpointer.save(step, parts)
        if self.saves and self.cfg.hf_every and step % self.cfg.hf_every == 0:
            self.export_hf(step, parts["policy"])

    def export_hf(self, step: int, policy) -> None:
        """The policy as an HF directory in <run_dir>/hf/step_N (checkpoint.hf_every). Collective: every
        rank takes part in the gathers; rank 0 writes, with the starting model's config and tokenizer."""
        from checkpoints.run_export import write_hf_export

        tensors = policy.export_hf()
        if self.checkpointer.rank != 0:
            for _ in tensors:
                pass
            return
        source = {"run": str(self.hf_root.parent), "step": step, "role": "policy", "from": "training"}
        write_hf_export(self.hf_root / f"step_{step}", tensors, self.model_path, source)

    def resume(self, parts: dict) -> Optional[Path]:
        """Load the checkpoint checkpoint.resume names (auto: the latest, if any) into `parts`. A
        checkpoint resolve_resume verified whole is not checksummed again (`verified`)."""
        if self.cfg.resume == "never":
            return None
        return self.checkpointer.load(parts, path=None if self.cfg.resume == "auto" else Path(self.cfg.resume),
                                      verified=self.verified)

    @staticmethod
    def preemption_flag() -> bool:
        """This rank's preemption flag; the loop agrees on it across ranks (agreement.py)."""
        from checkpoints.preemption import should_checkpoint_and_exit

        return should_checkpoint_and_exit(sync=False)


def resolve_resume(recipe: Recipe, rank: int, world_size: int, verified: Optional[dict] = None) -> Recipe:
    """Verify the checkpoint to resume from before any model is built: the recipe comes back with
    checkpoint.resume set to the verified directory (or 'never' when there is none). With 'auto' a newer
    checkpoint that fails verification is skipped for the previous good one, saying which and why in one
    line; a named one that fails, or no good one at all, is a one-line error (exit 2). `verified`, when
    given, receives the chosen checkpoint's top manifest: Checkpoints.resume then loads without hashing
    every file a second time."""
    from checkpoints.run_state import CheckpointCorruptError, RunCheckpointer

    cfg = recipe.checkpoint
    checkpointer = RunCheckpointer(recipe.run_dir / "checkpoints", keep_last=cfg.keep_last, rank=rank,
                                   world_size=world_size)
    try:
        chosen, skipped = checkpointer.choose(cfg.resume)
    except CheckpointCorruptError as err:
        problem, *fix = re.split(r"[;:] fix: ", str(err), maxsplit=1)   # the fix, once, after "; fix: "
        raise ConfigError("checkpoint.resume", problem, fix[0] if fix else "start over with checkpoint.resume=never") \
            from None
    if verified is not None and chosen is not None:
        verified.update(checkpointer.verified.get(chosen, {}))
    if skipped and rank == 0:
        print(f"checkpoint.resume=auto: skipped {'; '.join(skipped)}; resuming from {chosen.name}, the newest "
              "checkpoint that verifies", file=sys.stderr)
    resume = str(chosen) if chosen is not None else "never"
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(cfg, resume=resume))


def resumed_step(recipe: Recipe) -> int:
    """The step the run resumes at: its checkpoint's (resolve_resume set checkpoint.resume to it), else 0."""
    resume = recipe.checkpoint.resume
    if resume == "never":
        return 0
    if resume == "auto":   # not resolved (a loop built without entry.run_rank): the latest, as Checkpoints.resume
        from checkpoints.run_state import RunCheckpointer

        latest = RunCheckpointer(recipe.run_dir / "checkpoints", rank=0, world_size=1).latest()
        if latest is None or not (latest / "manifest.json").is_file():
            return 0
        resume = str(latest)
    return int(json.loads((Path(resume) / "manifest.json").read_text())["step"])


RANK_ERROR_ENV = "SAO_RANK_ERROR_FILE"   # set by the local launcher (entry.launch_local_ranks)


def rank_recipe_error(err: ConfigError, rank: int) -> int:
    """A recipe error found inside a rank of several (resolve_resume: the ranks agree on its outcome, so
    every rank has it): one line from rank 0, no traceback, exit 2 as `sao train` in one process.
    Under the local launcher rank 0 hands the error to it ($SAO_RANK_ERROR_FILE) and every rank exits 0:
    torchrun answers a non-zero exit with its own report and traceback; the launcher raises the error
    again (`raise_rank_recipe_error`), so the run ends with the single-process line and exit 2."""
    handoff = os.environ.get(RANK_ERROR_ENV)
    if rank == 0 and handoff:
        tmp = Path(handoff).with_suffix(".tmp")
        tmp.write_text(json.dumps({"field": err.field, "problem": err.problem, "fix": err.fix}))
        tmp.replace(handoff)
    elif rank == 0:
        print(f"sao train: recipe error: {err}", file=sys.stderr)
    return 0 if handoff else 2


def raise_rank_recipe_error(handoff: Path) -> None:
    """The launcher's side of `rank_recipe_error`: the ranks' recipe error, raised here (exit 2)."""
    if handoff.exists():
        data = json.loads(handoff.read_text())
        handoff.unlink()
        raise ConfigError(data["field"], data["problem"], data["fix"])


def checkpoint_parts(components, state) -> dict:
    """What one checkpoint holds on this rank (names are the files' names: keep them stable)."""
    from checkpoints.run_state import RngState

    parts = {"policy": components.policy, "trainer": state, "rng": RngState(cuda=False)}
    if components.critic is not None:
        parts["critic"] = components.critic
    if components.samples is not None:
        parts["driver"] = components.samples
    return parts


@dataclasses.dataclass
class StepStart:
    """The run at a step's start, for a save before the step's first model update (agreement.py): the
    trainer state and RNG states then, and (rank 0) the batch collected since, which goes back to the
    front of the saved buffer so a resume trains it at the same step, once."""

    trainer: dict
    rng: dict
    batch: Optional[list] = None

    @classmethod
    def take(cls, state) -> "StepStart":
        from checkpoints.run_state import RngState

        return cls(state.state_dict(), RngState(cuda=False).state_dict())


def step_start_parts(components, start: StepStart) -> dict:
    """What `checkpoint_parts` would have saved at the step's start (same names, same formats)."""
    from checkpoints.run_state import ValueState

    parts = checkpoint_parts(components, None)
    parts["trainer"] = ValueState(lambda: dict(start.trainer), None)
    parts["rng"] = ValueState(lambda: start.rng, None)
    if "driver" in parts and start.batch:
        source = components.samples
        parts["driver"] = ValueState(lambda: with_batch_returned(source.state_dict(), start.batch), None)
    return parts


def with_batch_returned(driver_state: dict, batch: list) -> dict:
    """A driver state_dict with `batch` (whole groups, oldest first) back at the front of its buffer."""
    groups: list[list] = []
    for sample in batch:
        if groups and groups[-1][0].group_id == sample.group_id:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    buffer = dict(driver_state["buffer"])
    buffer["ready"] = [[copy.deepcopy(s.to_dict()) for s in group] for group in groups] + list(buffer["ready"])
    return {**driver_state, "buffer": buffer}


def report_resume(loaded: Optional[Path], state, rank: int) -> None:
    if loaded is not None and rank == 0:
        print(f"resumed from {loaded} at step {state.step}, weight version {state.version}", file=sys.stderr)
