"""`sao serve`: run the reference rollout server (SGLang HTTP protocol, HF transformers on CPU).

    SAO_API_KEY=KEY sao serve --model DIR --host 127.0.0.1 --port 30000 [--max-batch 64]

The key travels in $SAO_API_KEY (``--api-key`` works too, but `ps` shows a command line to every
user); without one the weight and control routes answer 403 unless ``--insecure``. Flags are those
of `python -m rollout.engines.reference_server` (rollout/engines/reference_server/server.py). Exit codes: 0 after
SIGTERM/SIGINT, 2 for a bad flag (one line, before the model loads), 1 when the server fails
(scheduler error, failed warmup): one line naming the cause.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def register(sub) -> None:
    from rollout.engines.reference_server.server import add_arguments

    parser = sub.add_parser("serve", help="Run the reference rollout server (SGLang HTTP protocol, CPU)")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from rollout.engines.reference_server.server import options_from_args, serve

    try:
        opts = options_from_args(args)
        check_model_files(opts.model)
        check_max_batch(opts.model, opts.max_batch, opts.max_context, opts.dtype)
        serve(opts)
    except ValueError as err:
        print(f"sao serve: {err}", file=sys.stderr)
        return 2
    return 0


def check_model_files(model: str) -> None:
    """Every safetensors file of --model opens (its header, offsets within the file), before the model
    loads: a corrupt or truncated one used to be a traceback from transformers' loader."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(model).glob("*.safetensors"))
    if not files and (Path(model) / "config.json").is_file() and not any(Path(model).glob("*.bin")):
        raise ValueError(f"--model {model}: no weights there (*.safetensors); point it at an HF model directory "
                         "(make one with `sao init-model`)")
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise ValueError(f"--model {model}: {path.name} does not read as safetensors ({err}); fix: copy or "
                             "export the model again") from None


def check_max_batch(model: str, max_batch: int, max_context: int, dtype: str) -> None:
    """--max-batch sizes the KV cache the server allocates at start (model_runner.SlotCache: a
    [max_batch, kv_heads, min(256, context), head_dim] slab for keys and for values per layer): one this
    machine's memory cannot hold is refused here, not as a failed allocation after the model loads."""
    import json

    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return   # server.check_options names an unreadable config.json
    cfg = cfg.get("text_config") or cfg
    try:
        heads = int(cfg.get("num_attention_heads") or 1)
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 1) // heads)
        per_slot = 2 * int(cfg.get("num_hidden_layers") or 1) * int(cfg.get("num_key_value_heads") or heads) \
            * min(256, max_context or int(cfg.get("max_position_embeddings") or 256)) * head_dim \
            * (2 if dtype in ("bf16", "fp16") else 4)
    except (TypeError, ValueError):
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if max_batch * per_slot > memory:
        raise ValueError(f"--max-batch {max_batch}: its KV cache takes {max_batch * per_slot / 2**30:.3g} GiB at "
                         f"start, more than this machine's {memory / 2**30:.0f} GiB; use at most "
                         f"{max(1, memory // (2 * per_slot))}")
