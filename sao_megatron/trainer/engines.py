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
                handle = _launch_engine(recipe, index, api_key, run_dir)
                handles.append(handle)
                urls.append(handle.url)
        except BaseException:
            for handle in handles:  # a later engine failed to start: stop the earlier ones
                handle.stop()
            raise
    engines = engine_clients(recipe, urls, api_key)
    (run_dir / "engines.json").write_text(json.dumps({"urls": urls}))
    return engines, handles


def check_engine_can_take_updates(recipe: Recipe) -> None:
    """An FP8 SGLang engine cannot load our bf16 weight updates (SGLang 0.5.23, model_loader/loader.py):
    it re-quantizes reloaded bf16 weights only through the flash_rl loader, which accepts the
    Qwen2ForCausalLM and Qwen3ForCausalLM native loaders alone, and Fp8LinearMethod has no
    restore_weights_before_loading, so a distributed, tensor or disk update would write bf16 values into
    FP8 parameters. Refused on every rank before any engine or model starts."""
    from sao_megatron.core.config import ConfigError

    if recipe.rollout.engine_fp8 and recipe.rollout.engine == "sglang":
        raise ConfigError("rollout.engine_fp8", "an FP8 SGLang engine cannot take this trainer's bf16 weight "
                          "updates (SGLang 0.5.23 re-quantizes reloads only for Qwen2/Qwen3 dense models via "
                          "flash_rl; docs/cluster.md)",
                          "set rollout.engine_fp8 = false (bf16 engine weights)")


def engine_clients(recipe: Recipe, urls: list[str], api_key: str) -> list:
    """One SGLangEngine per URL, told the routes' shape from the model's config.json (SGLang does not
    report it); the same for the driver's clients and every stage sender's."""
    from rollout.sglang_client import SGLangEngine, route_shape_from_config

    shape = route_shape_from_config(recipe.model.path)
    return [SGLangEngine(url, api_key=api_key, name=f"engine{i}@{url}", timeout_s=recipe.rollout.request_timeout_s,
                         **shape) for i, url in enumerate(urls)]


def _launch_engine(recipe: Recipe, index: int, api_key: str, run_dir: Path, port: int | None = None):
    """Engine `index` on `port` (a restart passes the old one, so its client keeps working)."""
    rollout = recipe.rollout
    if port is None:
        port = rollout.port + index if rollout.port else 0
    if rollout.engine == "reference":
        from rollout.reference_server import launch_local

        # --tp N: the server joins the weight-update group as N ranks, as an SGLang engine with tp N does
        extra = ["--tp", str(rollout.engine_tp)] if rollout.engine_tp > 1 else []
        if recipe.weight_sync.method == "shard_writes":
            extra.append("--shard-writes")   # the opt-in stand-in for per-rank writes (shard_writes.py)
        return launch_local(Path(recipe.model.path).resolve(), host=rollout.host, port=port, api_key=api_key,
                            log_path=run_dir / f"engine{index}.log", seed=recipe.run.seed + index,
                            extra_args=extra or None)
    from rollout.sglang_launcher import launch_sglang

    return launch_sglang(recipe, index=index, port=port, api_key=api_key, log_path=run_dir / f"engine{index}.log")
