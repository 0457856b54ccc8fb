"""`sao export CHECKPOINT OUT [--role policy|critic] [--fp8]`: a run checkpoint as an HF model directory.

CHECKPOINT is runs/NAME/checkpoints/step_N, its `latest` pointer, the checkpoints/ folder or the run
directory. The model is built on this one process from the run's resolved recipe (layout 1: every
parallel size 1, no distributed optimizer), the checkpoint's weights are loaded into it and
`RLModel.export_hf()` is written with config.json, tokenizer and generation_config.json of the model the
run started from (checkpoints/run_export.py). A distributed checkpoint (checkpoint.format = distributed,
the default) loads under any layout: Megatron's dist_checkpointing reads each global tensor whole, from
whatever TP/PP/EP/VPP shards the run wrote. A per_rank checkpoint exports only when it was saved by one
rank (its shards are in the run's own layout).

--role critic exports the value model: the backbone and `score.weight` (the value head, one row), with
config.json saying <Family>ForTokenClassification and num_labels = 1 (transformers'
AutoModelForTokenClassification gives the values: logits[..., t, 0] is the value read at token t + 1).
--fp8 writes the block-FP8 (128x128) checkpoint FP8 engines load, with the quantizer of
`sao convert hf-to-fp8` (rollout/weights/fp8_checkpoint.py).

Memory: the whole model lives on this host with its optimizer's buffers (RLModel.build); an export of
a large model needs a host that holds it a few times over.
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
    parser.set_defaults(func=run)


def run(args) -> int:
    from checkpoints.run_export import NotARunCheckpoint, find_run_checkpoint

    try:
        if not 0 < args.max_shard_mb < float("inf"):
            raise ValueError(f"--max-shard-mb {args.max_shard_mb}: fix: pass a positive size in MiB (e.g. 4096)")
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} exists and is not empty; fix: pass a new directory")
        ckpt = find_run_checkpoint(args.checkpoint)
        written = export_run_checkpoint(ckpt, out, args.role, fp8=args.fp8, max_shard_mb=args.max_shard_mb)
    except (NotARunCheckpoint, ValueError, KeyError, FileNotFoundError) as err:
        print(f"sao export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def export_run_checkpoint(ckpt, out: Path, role: str = "policy", fp8: bool = False,
                          max_shard_mb: float = 4096) -> Path:
    """Write the `role` model of the run checkpoint `ckpt` (checkpoints.run_export.RunCheckpoint) to `out`."""
    from checkpoints.run_export import write_hf_export

    if not ckpt.has(role):
        raise ValueError(f"{ckpt.step_dir} holds no {role} (it holds {', '.join(ckpt.components)})"
                         + ("; fix: the run had critic.enabled = false, export the policy" if role == "critic" else ""))
    recipe = export_recipe(ckpt)
    source = ckpt.source(role)
    model = _load_model(ckpt, recipe, role)
    try:
        tensors = model.export_hf()
        update = {}
        if role == "critic":
            tensors, update = _as_token_classifier(tensors, model.hf_config)
        target = out.with_name(out.name + ".bf16-tmp") if fp8 else out
        write_hf_export(target, tensors, recipe.model.path, source, update, max_shard_mb)
    finally:
        _teardown()
    if fp8:
        from rollout.weights.fp8_checkpoint import write_block_fp8_checkpoint

        if out.exists():
            out.rmdir()   # run() checked it is empty; the FP8 writer wants a new directory
        write_block_fp8_checkpoint(target, out, max_shard_mb=max_shard_mb)
        shutil.rmtree(target)
    return out


def export_recipe(ckpt):
    """The run's resolved recipe, set for one process: every parallel size 1, the optimizer plain, no
    resume. The model (architecture, dtype, spec) stays the run's."""
    from checkpoints.arch import load_recipe

    one_process = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "etp": 0, "cp": 1, "dp": 0, "world_size": 1,
                   "last_stage_layers": 0, "sequence_parallel": "false", "distributed_optimizer": "false",
                   "optimizer_offload": "false"}
    overrides = [f"parallel.{k}={v}" for k, v in one_process.items()]
    overrides += ["checkpoint.resume='never'", "critic.placement='shared'"]
    recipe = load_recipe(ckpt.recipe_path, overrides, check_files=False)
    if not (Path(recipe.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {recipe.model.path} (from {ckpt.recipe_path}) has no config.json; fix: "
                                "run from the directory the run was started in, or restore the model it started from")
    return recipe


def _load_model(ckpt, recipe, role: str):
    """RLModel of `role` with the checkpoint's weights (not its optimizer state)."""
    from parallel.rl_model import RLModel

    model = RLModel.build(recipe, role)
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
    import torch

    if ckpt.world_size != 1:
        raise ValueError(f"{ckpt.step_dir} holds the {role} per rank (checkpoint.format = per_rank), saved by "
                         f"{ckpt.world_size} ranks; only a distributed checkpoint reshards; fix: resume the run for "
                         "one step with checkpoint.format = distributed and export that checkpoint")
    state = torch.load(ckpt.step_dir / f"{role}.rank00000.pt", map_location="cpu", weights_only=False)
    saved = {k: v for k, v in state.get("dims", {}).items() if k in ("tp", "pp", "ep", "vpp", "cp")}
    if any(v != 1 for v in saved.values()):
        raise ValueError(f"{ckpt.step_dir}: the {role} was saved per rank under {saved}; fix: export a distributed "
                         "checkpoint (checkpoint.format = distributed)")
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

    arch = next(iter(hf_config.get("architectures") or ["ForCausalLM"])).replace("ForCausalLM", "ForTokenClassification")
    return renamed(), {"architectures": [arch], "num_labels": 1, "id2label": {"0": "value"},
                       "label2id": {"value": 0}, "classifier_dropout": 0.0}


def _teardown() -> None:
    from parallel.distributed import teardown_model_parallel

    teardown_model_parallel()
