"""`sao sft`: supervised warm start of the policy on reference solutions, before RL.

The SAO paper starts RL from an SFT model; so can a recipe. SFT trains the same Megatron policy
(`RLModel`, the recipe's parallel layout) with token-level cross-entropy on the response tokens
of prompt/response pairs: a built-in task's reference solutions (`sft.task`, default
`rollout.task`) or a jsonl file of ``{"prompt", "response"}`` rows (`sft.dataset`). Prompts go
through the same chat template as rollouts, and each response ends with the EOS token, so the
model also learns to stop. The result is an HF model directory (`sft.output`, default
``<run_dir>/sft_model``) that `sao train` starts from:

    sao sft RECIPE            SFT only; then point model.path at the output
    sao train RECIPE          with sft.steps > 0: SFT first (skipped when the output already holds
                              this [sft] section's result), then RL from it

Micro-batches are built as RL builds them (batching.pack_samples): within parallel.micro_batch_tokens,
and with parallel.pack_sequences the samples run back to back without padding (the budget then
counts real tokens); the loss is the same either way.

Metrics (train/sft_loss, train/grad_norm, perf/step_time_s, perf/pad_fraction) go to
``<run_dir>/sft/metrics.jsonl``, wandb and the console, as in training. The loss is at temperature 1
(not rollout.temperature): SFT fits the data distribution itself.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sao_megatron.core.config import Recipe
from sao_megatron.core.records import LossOutputs, Sample, TrainBatch

MARKER = "sao_sft.json"   # the [sft] section (and base model) an output was trained with


def sft_output_dir(recipe: Recipe) -> Path:
    return Path(recipe.sft.output) if recipe.sft.output else recipe.run_dir / "sft_model"


def chain_sft(recipe: Recipe) -> Recipe:
    """`sao train` with sft.steps > 0: make sure the SFT model exists, then the recipe that starts RL from it."""
    out = sft_output_dir(recipe)
    if not _is_done(recipe, out):
        code = sft_from_recipe(recipe)
        if code != 0:
            raise RuntimeError(f"SFT ranks exited with code {code}; see their output above")
    else:
        print(f"sft: {out} already holds this recipe's SFT model; starting RL from it", file=sys.stderr)
    chained = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, path=str(out), init_preset=""))
    chained.source = recipe.source
    chained.dump(recipe.run_dir)   # the ranks read the resolved recipe: they must load the SFT model
    return chained


def sft_from_recipe(recipe: Recipe) -> int:
    """Entry point of `sao sft`: one rank in-process, or `parallel.world_size` ranks under torchrun."""
    from .run_dir import lock_if_first_rank, prepare_run_dir

    check_sft_data(recipe)
    lock_if_first_rank(recipe)
    prepare_run_dir(recipe)   # the base model (init_preset) and the run directory
    world = recipe.parallel.resolved_world_size()
    if world > 1 and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ \
            and "SLURM_PROCID" not in os.environ:
        resolved = recipe.run_dir / "sft_recipe.toml"
        resolved.write_text((recipe.run_dir / "resolved_recipe.toml").read_text())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "sao_megatron.trainer.sft", str(resolved)]
        print(f"sft: launching {world} ranks: {' '.join(cmd)}", file=sys.stderr)
        return subprocess.call(cmd)
    run_sft_rank(recipe)
    return 0


def check_sft_data(recipe: Recipe) -> None:
    """Refuse, before any model is built, SFT data that cannot give a prompt/response pair."""
    import random

    from sao_megatron.core.config import ConfigError

    if recipe.sft.dataset:
        if not Path(recipe.sft.dataset).is_file():
            raise ConfigError("sft.dataset", f"{recipe.sft.dataset} does not exist",
                              "give a jsonl file of {'prompt', 'response'} rows")
        return
    from rollout.rewards.tasks import get_task

    field = "sft.task" if recipe.sft.task else "rollout.task"
    try:
        task = get_task(_sft_task(recipe))
        task.solution(task.make(random.Random(0)).label)
    except ValueError as err:
        raise ConfigError(field, str(err).removeprefix("rollout.task: "),
                          "use a task with reference answers (chain:K:D, arithmetic, copy) or set sft.dataset") from None


def run_sft_rank(recipe: Recipe) -> Path:
    """One rank of SFT: build the policy as training does, train sft.steps steps, export on rank 0."""
    from parallel.distributed import init_distributed, single_process_port

    from .speed import pad_fraction

    single_process_port()
    env = init_distributed("auto")
    _seed(recipe.run.seed + env.rank)
    policy = _build_policy(recipe)
    source, tokenizer = _sft_source(recipe)
    sink = _build_sink(recipe) if env.rank == 0 else None
    try:
        for step in range(1, recipe.sft.steps + 1):
            started = time.perf_counter()
            batches = sft_batches([next_pair(source, tokenizer, recipe) for _ in range(recipe.sft.batch_size)],
                                  recipe.parallel.micro_batch_tokens, packed=recipe.parallel.pack_sequences)
            stats = policy.train_step(_my_share(batches), sft_loss_fn)
            if sink is not None:
                sink.log({"train/sft_loss": stats["sft_loss"], "train/grad_norm": stats["grad_norm"],
                          "train/lr": stats["lr"], "perf/step_time_s": time.perf_counter() - started,
                          "perf/pad_fraction": pad_fraction(batches)}, step)
    finally:
        if sink is not None:
            sink.close()
    return _export(recipe, policy, env.rank)


def sft_loss_fn(batch: TrainBatch, outputs: dict) -> LossOutputs:
    """Token-level cross-entropy on response tokens, scaled so micro-batches sum to the step's token mean."""
    logp, mask = outputs["logp"], batch.loss_mask
    loss = -(logp * mask).sum() / max(float(batch.global_num_tokens), 1.0)
    return LossOutputs(loss, {"sft_loss": loss.detach()})


def sft_batches(pairs: list[tuple[list[int], list[int]]], token_budget: int, packed: bool = False) -> list[TrainBatch]:
    """(prompt_ids, response_ids) pairs -> micro-batches with a loss mask over every response token, made by
    the RL path's packer; ``packed`` (parallel.pack_sequences): the budget counts real tokens and the model
    runs each micro-batch's samples back to back."""
    from .batching import pack_samples

    samples = [Sample(uid=f"sft-{i}", prompt_index=i, prompt_ids=list(p), response_ids=list(r),
                      loss_mask=[1] * len(r), rollout_logprobs=[0.0] * len(r), weight_versions=[0] * len(r))
               for i, (p, r) in enumerate(pairs)]
    return pack_samples(samples, token_budget, with_routes=False, packed=packed).batches


def next_pair(source, tokenizer, recipe: Recipe) -> tuple[list[int], list[int]]:
    """The next prompt of the SFT stream and its reference response (tokens, EOS appended)."""
    prompt = source.next()
    text = None
    if recipe.sft.dataset:   # the response field is read as the label (_sft_source)
        text = prompt.label
        if text is None:
            raise ValueError(f"sft.dataset row {prompt.metadata.get('line')} has no {recipe.sft.response_key!r} "
                             "field; fix the row or set sft.response_key")
    else:
        from rollout.rewards.tasks import get_task

        text = get_task(_sft_task(recipe)).solution(prompt.label)
    response = list(tokenizer.encode(str(text), add_special_tokens=False)) + [tokenizer.eos_token_id]
    return prompt.prompt_ids, response


def _sft_task(recipe: Recipe) -> str:
    return recipe.sft.task or recipe.rollout.task


def _sft_source(recipe: Recipe):
    """The SFT prompt stream: sft.dataset, else the task's problems under a seed apart from RL's prompts."""
    from transformers import AutoTokenizer

    from rollout.prompts import build_prompt_source

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    cfg = dataclasses.replace(recipe.rollout, dataset=recipe.sft.dataset, task=_sft_task(recipe),
                              prompt_key=recipe.sft.prompt_key, label_key=recipe.sft.response_key)
    return build_prompt_source(cfg, tokenizer, seed=recipe.run.seed * 7919 + 17), tokenizer


def _build_policy(recipe: Recipe):
    from parallel.rl_model import RLModel
    from safetensors.torch import load_file

    hf = {}
    for shard in sorted(Path(recipe.model.path).glob("*.safetensors")):
        hf.update(load_file(shard))
    # SFT runs sft.lr constant: the algorithm's lr schedule spans the RL run's steps, not SFT's
    sft_recipe = dataclasses.replace(recipe, algorithm=dataclasses.replace(recipe.algorithm, lr=recipe.sft.lr,
                                                                           lr_schedule="constant", lr_warmup_steps=0))
    policy = RLModel.build(sft_recipe, "policy")
    policy.load_hf_state_dict(hf)
    policy.temperature = 1.0
    return policy


def _build_sink(recipe: Recipe):
    from sao_megatron.metrics import build_metric_sink
    from sao_megatron.metrics.rewind import rewind_metrics

    sft_dir = recipe.run_dir / "sft"
    rewind_metrics(sft_dir, 0, "")   # SFT always starts at step 1: rows of an earlier, unfinished SFT go
    return build_metric_sink(recipe.logging, f"{recipe.run.name}-sft", sft_dir, recipe.sft.steps, recipe.to_dict())


def _export(recipe: Recipe, policy, rank: int) -> Path:
    """Every rank takes part in the gather; rank 0 writes the HF directory and its marker."""
    from checkpoints.hf_io import save_hf_checkpoint

    out = sft_output_dir(recipe)
    tensors = policy.export_hf()
    if rank != 0:
        for _ in tensors:
            pass
        return out
    (out / MARKER).unlink(missing_ok=True)   # until the new model is whole, no marker may call it done
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_hf_checkpoint(out, tensors, aux_from=recipe.model.path)
    (out / MARKER).write_text(json.dumps(_marker(recipe), indent=1))
    print(f"sft: {recipe.sft.steps} steps; model written to {out}", file=sys.stderr)
    return out


def _marker(recipe: Recipe) -> dict:
    return {"sft": dataclasses.asdict(recipe.sft), "base_model": str(recipe.model.path), "seed": recipe.run.seed}


def _is_done(recipe: Recipe, out: Path) -> bool:
    marker = out / MARKER
    return marker.exists() and json.loads(marker.read_text()) == _marker(recipe)


def _my_share(batches):
    """The micro-batches this data-parallel rank trains on (as the RL loop shares them)."""
    from parallel.distributed import data_parallel_coords

    from .batching import shard_for_data_parallel

    return shard_for_data_parallel(batches, *data_parallel_coords())


def _seed(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


if __name__ == "__main__":
    from checkpoints.arch import load_recipe

    run_sft_rank(load_recipe(sys.argv[1], sys.argv[2:]))
