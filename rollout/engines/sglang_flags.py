"""The flags `python -m sglang.launch_server` (SGLang 0.5.23) accepts, and the check of rollout.engine_args.

sglang_flags.json maps every flag to [arity, destination field]; arity is 0 (a switch), 1, "?", "*" or
"+" as argparse reads it. It is generated from the wheel's source by tests/support/sglang_cli.py, and
tests/unit/rollout/engines/test_sglang_contract.py fails when the two differ, so a pinned-version bump regenerates it.
SGLang itself is never imported: it is absent on CPU machines and on the host that renders a job.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from sao_megatron.core.config import ConfigError

FIELD = "rollout.engine_args"

# Destinations the launcher sets from the recipe (rollout/engines/sglang_launcher.py build_sglang_command). A repeat in
# engine_args would win (argparse keeps the last value) and silently undo the recipe field named here.
MANAGED = {
    "model_path": "rollout.engine_model_path / model.path", "host": "rollout.host", "port": "rollout.port",
    "tp_size": "rollout.engine_tp", "ep_size": "rollout.engine_ep", "attn_dp_size": "rollout.engine_dp_attention",
    "enable_dp_attention": "rollout.engine_dp_attention", "dp_size": "rollout.num_engines",
    "mem_fraction_static": "rollout.mem_fraction", "quantization": "rollout.engine_fp8",
    "random_seed": "run.seed", "base_gpu_id": "the engine placement", "nnodes": "the engine placement",
    "node_rank": "the engine placement", "dist_init_addr": "the engine placement",
    "config": "rollout.api_key (the key's options file)", "api_key": "rollout.api_key",
    "weight_version": "weight sync (versions are step numbers)",
    "enable_return_routed_experts": "routing replay (always on)",
    "enable_return_indexer_topk": "indexer replay (on for DSA models)",
}


@functools.lru_cache(maxsize=1)
def sglang_flags() -> dict[str, tuple[object, str]]:
    """{flag: (arity, destination)} of SGLang 0.5.23's server."""
    table = json.loads((Path(__file__).with_name("sglang_flags.json")).read_text())
    return {flag: (arity, dest) for flag, (arity, dest) in table.items()}


def parse_flags(argv: list[str], table: dict | None = None) -> list[tuple[str, str, list[str]]]:
    """[(flag, destination, values)] of an SGLang argv tail, or ValueError naming the first token SGLang's
    parser would refuse: an unknown flag, a value where none is taken, a missing value, a stray word.
    Exact names only (argparse would also take an unambiguous prefix; a prefix breaks when a flag is added)."""
    table = sglang_flags() if table is None else table
    out: list[tuple[str, str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ValueError(f"{token!r} is not a flag and follows no flag that takes a value")
        flag, eq, inline = token.partition("=")
        if flag not in table:
            raise ValueError(f"SGLang 0.5.23 has no flag {flag}")
        arity, dest = table[flag]
        values = [inline] if eq else []
        i += 1
        if not eq and arity != 0:
            while i < len(argv) and not argv[i].startswith("--") and (arity in ("*", "+") or not values):
                values.append(argv[i])
                i += 1
        if arity == 0 and (eq or values):
            raise ValueError(f"{flag} is a switch and takes no value")
        if (arity == 1 or arity == "+") and not values:
            raise ValueError(f"{flag} needs a value")
        out.append((flag, dest, values))
    return out


def check_engine_args(args: object) -> None:
    """ConfigError naming rollout.engine_args for anything SGLang's parser (or this run) would not take."""
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(FIELD, f"{args!r} is not a list of strings", 'write e.g. ["--chunked-prefill-size", "4096"]')
    for arg in args:
        if any(ord(c) < 32 or ord(c) == 127 for c in arg):
            raise ConfigError(FIELD, f"{arg!r} holds a control character", "write each flag and value on one line")
    try:
        parsed = parse_flags(args)
    except ValueError as err:
        raise ConfigError(FIELD, str(err), "use flags of `python -m sglang.launch_server --help` (SGLang 0.5.23), "
                          "each value its own list item") from None
    for flag, dest, values in parsed:
        if dest == "json_model_override_args" and not _json_object(values[0]):
            raise ConfigError(FIELD, f"{flag} {values[0]!r} is not a JSON object", 'write e.g. \'{"key": value}\'')
        if dest in MANAGED:
            raise ConfigError(FIELD, f"{flag} is set by the launcher from {MANAGED[dest]}", "set that instead")
        if dest.startswith("speculative_"):
            raise ConfigError(FIELD, f"{flag}: speculative decoding is off for RL engines (weight sync never updates "
                              "draft weights: MTP / EAGLE layers or a draft model go stale after the first update)",
                              "remove it (docs/cluster.md, 'Speculative decoding')")


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
