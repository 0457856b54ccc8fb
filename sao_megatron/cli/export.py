"""`sao export CHECKPOINT OUT [--role policy|critic] [--fp8]`: a run checkpoint as an HF model directory.

CHECKPOINT is runs/NAME/checkpoints/step_N, its `latest` pointer, the checkpoints/ folder or the run
directory. The model is built on this one process from the run's resolved recipe (layout 1: every
parallel size 1, no distributed optimizer), the checkpoint's weights are loaded into it and
`RLModel.export_hf()` is written with config.json, tokenizer and generation_config.json of the model the
run started from (checkpoints/run_export.py). A distributed checkpoint (checkpoint.format = distributed,
the default) loads under any layout: Megatron's dist_checkpointing reads each global tensor whole, from
whatever TP/PP/EP/VPP shards the run wrote. A per_rank checkpoint holds each rank's shards of the run's
own layout: one saved by N > 1 ranks is exported by N local ranks (torchrun) rebuilding that layout,
each loading its own file, rank 0 writing (--timeout-s bounds them).

--role critic exports the value model: the backbone and `score.weight` (the value head, one row), with
config.json saying <Family>ForTokenClassification and num_labels = 1 (transformers'
AutoModelForTokenClassification gives the values: logits[..., t, 0] is the value read at token t + 1).
--fp8 writes the block-FP8 (128x128) checkpoint FP8 engines load, with the quantizer of
`sao convert hf-to-fp8` (rollout/weights/fp8_checkpoint.py).

Memory: the whole model lives on this host (one process) or on the run's ranks (per_rank): the policy
as its weights alone (RLModel's forward-only "reference" build), the critic with its optimizer's
buffers too (about 5x its bf16 weights).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("export", help="Run checkpoint (any layout) -> HF model directory (safetensors, config, "
                                           "tokenizer); --fp8 for FP8 engines")
    parser.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N, .../checkpoints/latest, .../checkpoints "
                                           "or runs/NAME (the newest checkpoint)")
    parser.add_argument("out", help="HF directory to write (a new or empty directory)")
    parser.add_argument("--role", choices=["policy", "critic"], default="policy", help="which model to export")
    parser.add_argument("--fp8", action="store_true", help="write the block-FP8 (128x128) engine checkpoint")
    parser.add_argument("--max-shard-mb", type=float, default=4096, help="largest safetensors file")
    parser.add_argument("--timeout-s", type=float, default=7200,
                        help="per_rank checkpoints of several ranks: how long the export ranks may take")
    parser.set_defaults(func=run)


def run(args) -> int:
    from checkpoints.run_export import NotARunCheckpoint, find_run_checkpoint

    try:
        if not 0 < args.max_shard_mb < float("inf"):
            raise ValueError(f"--max-shard-mb {args.max_shard_mb}: fix: pass a positive size in MiB (e.g. 4096)")
        if not 0 < args.timeout_s < float("inf"):
            raise ValueError(f"--timeout-s {args.timeout_s}: fix: pass a positive number of seconds")
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} exists and is not empty; fix: pass a new directory")
        ckpt = find_run_checkpoint(args.checkpoint)
        written = export_run_checkpoint(ckpt, out, args.role, fp8=args.fp8, max_shard_mb=args.max_shard_mb,
                                        timeout_s=args.timeout_s)
    except (NotARunCheckpoint, ValueError, KeyError, FileNotFoundError) as err:
        print(f"sao export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def export_run_checkpoint(ckpt, out: Path, role: str = "policy", fp8: bool = False,
                          max_shard_mb: float = 4096, timeout_s: float = 7200) -> Path:
    """Write the `role` model of the run checkpoint `ckpt` (checkpoints.run_export.RunCheckpoint) to `out`."""
    if not ckpt.has(role):
        raise ValueError(f"{ckpt.step_dir} holds no {role} (it holds {', '.join(ckpt.components)})"
                         + ("; fix: the run had critic.enabled = false, export the policy" if role == "critic" else ""))
    target = out.with_name(out.name + ".bf16-tmp") if fp8 else out
    if role in ckpt.distributed or ckpt.world_size == 1:
        export_model(ckpt, target, role, max_shard_mb, one_process=True)
    else:
        _launch_ranks(ckpt, target, role, max_shard_mb, timeout_s)
    if fp8:
        from rollout.weights.fp8_checkpoint import write_block_fp8_checkpoint

        if out.exists():
            out.rmdir()   # run() checked it is empty; the FP8 writer wants a new directory
        write_block_fp8_checkpoint(target, out, max_shard_mb=max_shard_mb)
        shutil.rmtree(target)
    return out


def export_model(ckpt, out: Path, role: str, max_shard_mb: float, one_process: bool) -> None:
    """Build the model (one process, or this rank of the run's own layout), load the checkpoint's weights,
    export. Collective with several ranks: every rank gathers, rank 0 writes."""
    import torch

    from checkpoints.run_export import write_hf_export

    recipe = export_recipe(ckpt, one_process)
    model = _load_model(ckpt, recipe, role)
    try:
        tensors = model.export_hf()
        if torch.distributed.get_rank() != 0:
            for _ in tensors:
                pass
            return
        update = {}
        if role == "critic":
            tensors, update = _as_token_classifier(tensors, model.hf_config)
        write_hf_export(out, tensors, recipe.model.path, ckpt.source(role), update, max_shard_mb)
    finally:
        _teardown()


def _launch_ranks(ckpt, out: Path, role: str, max_shard_mb: float, timeout_s: float) -> None:
    """A per_rank checkpoint of N ranks holds shards of the run's layout: rebuild that layout on N local
    ranks (torchrun), each loading its own file, and export from there."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ckpt.world_size}",
           "-m", "sao_megatron.cli.export", str(ckpt.step_dir), str(out), role, str(max_shard_mb)]
    print(f"sao export: {ckpt.step_dir} was saved per rank by {ckpt.world_size} ranks; launching as many: "
          f"{' '.join(cmd)}", file=sys.stderr)
    try:
        code = subprocess.run(cmd, timeout=timeout_s, env={**os.environ}).returncode
    except subprocess.TimeoutExpired:
        raise ValueError(f"the {ckpt.world_size} export ranks did not finish in {timeout_s:.0f} s; fix: pass a "
                         "larger --timeout-s") from None
    if code != 0:
        raise ValueError(f"the {ckpt.world_size} export ranks exited with code {code} (their output is above)")


def export_recipe(ckpt, one_process: bool = True):
    """The run's resolved recipe for the export: one process (every parallel size 1), or the run's own
    layout on as many ranks as saved the checkpoint; the optimizer plain, no resume. The model
    (architecture, dtype, spec) stays the run's."""
    from checkpoints.arch import load_recipe

    layout = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "etp": 0, "cp": 1, "dp": 0, "world_size": 1,
              "last_stage_layers": 0, "sequence_parallel": "false"} if one_process else {"world_size": ckpt.world_size}
    layout.update(distributed_optimizer="false", optimizer_offload="false")   # Adam state is never loaded
    overrides = [f"parallel.{k}={v}" for k, v in layout.items()]
    overrides += ["checkpoint.resume='never'", "critic.placement='shared'"]
    recipe = load_recipe(ckpt.recipe_path, overrides, check_files=False)
    if not (Path(recipe.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {recipe.model.path} (from {ckpt.recipe_path}) has no config.json; fix: "
                                "run from the directory the run was started in, or restore the model it started from")
    return recipe


def _load_model(ckpt, recipe, role: str):
    """RLModel of `role` with the checkpoint's weights (not its optimizer state). The policy is built as
    the trainer builds its reference model: the policy's network, forward only, no optimizer and no
    gradient buffers (the critic has no such form yet: it is built with its optimizer)."""
    from parallel.rl_model import RLModel

    model = RLModel.build(recipe, "reference" if role == "policy" else role)
    if role in ckpt.distributed:
        _load_distributed_weights(model, ckpt.step_dir / role)
    else:
        _load_per_rank_weights(model, ckpt, role)
    return model


def _load_distributed_weights(model, path: Path) -> None:
    """The model part of RLModel.save_distributed's checkpoint (keys model0..; the optimizer's are left
    on disk: dist_checkpointing.load reads only the requested tensors, StrictHandling.ASSUME_OK_UNEXPECTED,
    megatron/core/dist_checkpointing/serialization.py)."""
    from megatron.core import dist_checkpointing

    wanted = {f"model{i}": module.sharded_state_dict() for i, module in enumerate(model.modules)}
    loaded = dist_checkpointing.load(wanted, str(path))
    for i, module in enumerate(model.modules):
        module.load_state_dict(loaded[f"model{i}"])


def _load_per_rank_weights(model, ckpt, role: str) -> None:
    """This rank's file of a per_rank checkpoint (the model shards; the optimizer's state stays unread)."""
    import torch

    rank = torch.distributed.get_rank()
    state = torch.load(ckpt.step_dir / f"{role}.rank{rank:05d}.pt", map_location="cpu", weights_only=False)
    keys = ("tp", "pp", "vpp", "ep", "etp", "cp")
    saved, built = ({k: d.get(k) for k in keys} for d in (state.get("dims", {}), model.dims.__dict__))
    if saved != built:
        raise ValueError(f"{ckpt.step_dir}: the {role} was saved per rank under {saved}, the export built {built}; "
                         "fix: restore the run's resolved_recipe.toml, or export a distributed checkpoint")
    for module, sd in zip(model.modules, state["model"]):
        module.load_state_dict(sd)


def _as_token_classifier(tensors, hf_config: dict):
    """The critic's HF form: value_head.weight -> score.weight (+ a zero score.bias: transformers'
    token-classification head is nn.Linear with a bias, modeling_layers.py GenericForTokenClassification)."""
    import torch

    from parallel.weights import VALUE_HEAD

    def renamed():
        for name, tensor in tensors:
            if name == VALUE_HEAD:
                yield "score.weight", tensor
                yield "score.bias", torch.zeros(tensor.shape[0], dtype=tensor.dtype)
            else:
                yield name, tensor

    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    causal = next(iter(hf_config.get("architectures") or ["ForCausalLM"]))
    arch = causal.replace("ForCausalLM", "ForTokenClassification")
    model_type = hf_config.get("model_type", "")
    if model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        print(f"sao export: transformers has no token-classification model for {model_type!r}: the critic's "
              "weights are written (backbone + score.weight), but AutoModelForTokenClassification will not load "
              "them", file=sys.stderr)
    return renamed(), {"architectures": [arch], "num_labels": 1, "id2label": {"0": "value"},
                       "label2id": {"value": 0}, "classifier_dropout": 0.0}


def _teardown() -> None:
    from parallel.distributed import teardown_model_parallel

    teardown_model_parallel()


if __name__ == "__main__":   # one rank of a per_rank export (_launch_ranks): CHECKPOINT OUT ROLE MAX_SHARD_MB
    from checkpoints.run_export import find_run_checkpoint

    export_model(find_run_checkpoint(sys.argv[1], verify=False), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]),
                 one_process=False)
