"""A PlanInput from a loaded recipe (what `sao plan` reads), and the options tried when nothing fits."""
from __future__ import annotations

from dataclasses import replace

from rollout.engines.sglang_launcher import has_indexer

from .engine import EngineOptions
from .hardware import GPUS
from .layouts import Layout
from .plan import PlanInput
from .trainer import TrainOptions


def model_config_of(recipe) -> dict:
    """The HF config the plan uses: model.shape_preset if set, else model.path/config.json."""
    import json
    from pathlib import Path

    from sao_megatron.core.config import ConfigError

    from ..model_shapes import get_shape

    if recipe.model.shape_preset:
        try:
            return get_shape(recipe.model.shape_preset)
        except KeyError as err:
            raise ConfigError("model.shape_preset", str(err.args[0]),
                              "pick a listed name (each family's SHAPES in checkpoints/arch/)") from None
    config = Path(recipe.model.path) / "config.json"
    if not config.is_file():
        raise ConfigError("model.path", f"{config} does not exist and model.shape_preset is empty",
                          "set model.shape_preset (e.g. 'glm5-744b-a40b') or point model.path at a local model")
    return json.loads(config.read_text())


def plan_input_from_recipe(recipe, gpus: int = 0, gpu: str = "h100", **options) -> PlanInput:
    """PlanInput from a loaded recipe. gpus = 0 takes launch.nodes · launch.gpus_per_node.
    `options` sets PlanInput/TrainOptions/EngineOptions fields the recipe has no key for
    (critic_placement, kv_dtype, include_mtp) or overrides the recipe's (optimizer_offload,
    critic_placement: parallel.optimizer_offload and critic.placement)."""
    par, roll, launch = recipe.parallel, recipe.rollout, recipe.launch
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown; use one of {', '.join(GPUS)}")
    per_node = launch.gpus_per_node or 1
    gpus = gpus or launch.nodes * per_node
    train = TrainOptions(dtype=recipe.model.dtype, fp8=recipe.model.fp8, recompute=recipe.model.recompute,
                         micro_batch_tokens=par.micro_batch_tokens, distributed_optimizer=par.distributed_optimizer,
                         kernels="local" if recipe.model.transformer_impl == "local" else "te",
                         seq_len=min(roll.max_prompt_len + roll.max_new_tokens, par.micro_batch_tokens),
                         optimizer_offload=par.optimizer_offload if options.get("optimizer_offload") is None
                         else options.pop("optimizer_offload"))
    options.pop("optimizer_offload", None)
    cfg = model_config_of(recipe)
    # the launcher's rule: a DSA model's engines run DP attention across the engine (rollout/engines/sglang_launcher.py)
    dp_attention = roll.engine_dp_attention or (roll.engine_tp if has_indexer(cfg) and roll.engine_tp > 1 else 0)
    engine = EngineOptions(tp=roll.engine_tp, ep=roll.engine_ep, dp_attention=dp_attention,
                           mem_fraction=roll.mem_fraction, fp8_weights=roll.engine_fp8,
                           kv_dtype=options.pop("kv_dtype", "bf16"), include_mtp=options.pop("include_mtp", False))
    layout = Layout(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp or par.tp, cp=par.cp, vpp=par.vpp,
                    last_stage_layers=par.last_stage_layers)
    return PlanInput(cfg=cfg, gpus=gpus, gpu=GPUS[gpu], gpus_per_node=per_node,
                     rollout_gpus=launch.rollout_nodes * per_node, layout=layout, train=train, engine=engine,
                     critic=recipe.critic.enabled, freeze_attention=recipe.critic.freeze_attention,
                     sequence_tokens=roll.max_prompt_len + roll.max_new_tokens, max_in_flight=roll.max_in_flight,
                     bucket_bytes=recipe.weight_sync.bucket_mb * 2 ** 20,
                     max_sender_bytes=recipe.weight_sync.max_sender_mb * 2 ** 20,
                     sync_method=recipe.weight_sync.method, shard_senders=recipe.weight_sync.shard_senders,
                     reference=recipe.algorithm.kl_coef > 0,
                     **{"critic_placement": recipe.critic.placement, **options})


OPTION_LADDER = [  # tried in order when the recipe's own settings fit no layout
    {},
    {"critic_placement": "swap"},
    {"optimizer_offload": True},
    {"optimizer_offload": True, "critic_placement": "swap"},
]


def with_options(inp: PlanInput, options: dict) -> PlanInput:
    train = replace(inp.train, optimizer_offload=options.get("optimizer_offload", inp.train.optimizer_offload))
    return replace(inp, train=train, critic_placement=options.get("critic_placement", inp.critic_placement))
