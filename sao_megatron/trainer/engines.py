"""The engines of a run: started here (reference server or SGLang) or reached at rollout.engine_urls,
and one client per engine, the same for the rollout driver and every stage's weight sender."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from sao_megatron.core.config import Recipe


async def start_engines(recipe: Recipe, run_dir: Path):
    """Connect to recipe.rollout.engine_urls, or start num_engines local engines. Returns (engines, handles)."""
    rollout = recipe.rollout
    # $SAO_API_KEY first: a rendered sbatch script hands the key to engines and trainer in the
    # environment only (never on a command line, where `ps` shows it)
    api_key = os.environ.get("SAO_API_KEY") or rollout.api_key or secrets.token_hex(16)
    handles = []
    urls = list(rollout.engine_urls)
    if not urls:
        try:
            for index in range(rollout.num_engines):
                handle = launch_engine(recipe, index, api_key, run_dir)
                handles.append(handle)
                urls.append(handle.url)
        except BaseException:
            for handle in handles:  # a later engine failed to start: stop the earlier ones
                handle.stop()
            raise
    engines = engine_clients(recipe, urls, api_key)
    (run_dir / "engines.json").write_text(json.dumps({"urls": urls}))
    return engines, handles


# model_types whose SGLang 0.5.23 loader we read for block-FP8 updates: Qwen3MoeForCausalLM and
# Glm4MoeForCausalLM (stacked and FusedMoE expert mappings route `<name>_scale_inv` like the weight:
# models/qwen3_moe.py:1157-, models/glm4_moe.py:1071-), GLM-5 / DeepSeek-V3 (DeepSeek weight loader,
# which re-derives MLA's w_kc/w_vc from kv_b_proj's FP8 weight and scale after each load:
# models/deepseek_common/deepseek_weight_loader.py:550, :586-661)
FP8_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "glm_moe_dsa", "deepseek_v3")


def engine_weight_dtype(recipe: Recipe):
    """The dtype weight sync casts to (None: as the trainer holds them): a bf16 reference engine refuses fp32
    tensors (rollout.engine_dtype)."""
    import torch

    return torch.bfloat16 if recipe.rollout.engine_dtype == "bf16" else None


def engine_model_path(recipe: Recipe) -> str:
    """The checkpoint the engines load: rollout.engine_model_path, else model.path."""
    return recipe.rollout.engine_model_path or str(recipe.model.path)


def check_engine_can_take_updates(recipe: Recipe) -> None:
    """An FP8 engine takes our updates only as 128x128 FP8 blocks with their scales (rollout/weights/
    fp8_blocks.py), so with rollout.engine_fp8: broadcast or disk sync (shard writes do not slice
    blocks per rank) and, for SGLang, a block-FP8 checkpoint of a family whose loader we read. SGLang
    given a bf16 checkpoint with --quantization fp8 quantizes it per channel at load and replaces the
    parameters (layers/quantization/fp8.py:1160-1176, :2619-2641), so no update could land in them.
    Refused on every rank before any engine or model starts, naming the field."""
    from sao_megatron.core.config import ConfigError

    rollout = recipe.rollout
    if not rollout.engine_fp8:
        return
    if recipe.weight_sync.method == "shard_writes":
        raise ConfigError("weight_sync.method", "shard writes do not slice FP8 blocks and their scales per engine "
                          "rank (rollout.engine_fp8 = true)", "use weight_sync.method = 'broadcast'")
    if rollout.engine != "sglang":   # the reference server makes the block-FP8 version of an unquantized checkpoint
        config_path = Path(engine_model_path(recipe)) / "config.json"
        if config_path.is_file() and "quantization_config" in json.loads(config_path.read_text()):
            raise ConfigError("rollout.engine_model_path", f"{config_path} is a quantized checkpoint; the reference "
                              "server (--quantization fp8) loads an unquantized one and makes its FP8 blocks itself",
                              "leave rollout.engine_model_path empty (model.path) for reference engines")
        return
    _check_block_fp8_checkpoint(engine_model_path(recipe))


def _check_block_fp8_checkpoint(path: str) -> None:
    from rollout.weights.fp8_blocks import layout_from_model_dir
    from sao_megatron.core.config import ConfigError

    field = "rollout.engine_model_path"
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ConfigError(field, f"{config_path} does not exist; an FP8 SGLang engine needs its block-FP8 "
                          "checkpoint here to check", "set rollout.engine_model_path to that checkpoint")
    try:
        layout_from_model_dir(path)
    except ValueError as err:
        raise ConfigError(field, str(err), "set rollout.engine_model_path to a block-FP8 checkpoint of the model "
                          "(quantization_config quant_method fp8, weight_block_size [128, 128])") from None
    model_type = json.loads(config_path.read_text()).get("model_type", "")
    if model_type not in FP8_MODEL_TYPES:
        raise ConfigError(field, f"model_type {model_type!r}: its SGLang loader was not checked for FP8 updates "
                          f"(checked: {', '.join(FP8_MODEL_TYPES)})", "set rollout.engine_fp8 = false")


def engine_fp8_layout(recipe: Recipe):
    """The Fp8Layout weight sync quantizes for (None without rollout.engine_fp8): the SGLang engines'
    checkpoint's, or the one the reference server derives from model.path."""
    if not recipe.rollout.engine_fp8:
        return None
    from rollout.weights.fp8_blocks import layout_from_model_dir

    if recipe.rollout.engine == "sglang":
        return layout_from_model_dir(engine_model_path(recipe))
    from rollout.engines.reference_server.fp8_weights import layout_for_model

    path = engine_model_path(recipe)
    return layout_for_model(path, json.loads((Path(path) / "config.json").read_text()))


def engine_clients(recipe: Recipe, urls: list[str], api_key: str) -> list:
    """One SGLangEngine per URL, told the routes' and the DSA indexer's shapes from the model's
    config.json (SGLang reports neither); the same for the driver's clients and every stage sender's."""
    from rollout.engines.indexer_topk import indexer_shape_from_config
    from rollout.engines.routed_experts import route_shape_from_config
    from rollout.engines.sglang_client import SGLangEngine

    shape = {**route_shape_from_config(recipe.model.path), **indexer_shape_from_config(recipe.model.path)}
    return [SGLangEngine(url, api_key=api_key, name=f"engine{i}@{url}", timeout_s=recipe.rollout.request_timeout_s,
                         **shape) for i, url in enumerate(urls)]


def launch_engine(recipe: Recipe, index: int, api_key: str, run_dir: Path, port: int | None = None):
    """Engine `index` on `port` (a restart passes the old one, so its client keeps working)."""
    rollout = recipe.rollout
    if port is None:
        port = rollout.port + index if rollout.port else 0
    if rollout.engine == "reference":
        from rollout.engines.reference_server import launch_local
        from rollout.engines.sglang_launcher import engine_seed, reference_server_args

        return launch_local(Path(engine_model_path(recipe)).resolve(), host=rollout.host, port=port, api_key=api_key,
                            log_path=run_dir / f"engine{index}.log", seed=engine_seed(recipe, index),
                            extra_args=reference_server_args(recipe))
    from rollout.engines.sglang_launcher import launch_sglang

    return launch_sglang(recipe, index=index, port=port, api_key=api_key, log_path=run_dir / f"engine{index}.log")
