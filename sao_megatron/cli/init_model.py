"""`sao init-model`: write a randomly initialised HF model and a locally built tokenizer."""
from __future__ import annotations

import sys


def register(sub) -> None:
    from checkpoints.arch import ARCHS

    parser = sub.add_parser("init-model", help="Create a random-weight HF model + local tokenizer (no download)")
    parser.add_argument("out_dir", help="directory to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--arch", default="qwen3_moe", choices=list(ARCHS), help="architecture family")
    parser.add_argument("--preset", default="tiny", help="shape preset: tiny (4 layers, 8 experts, top-2; GLM: first layer dense) or small (qwen3_moe)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="saved dtype")
    parser.set_defaults(func=run)


def run(args) -> int:
    from checkpoints.init_model import PRESETS, init_model

    if (args.arch, args.preset) not in PRESETS:
        known = ", ".join(p for a, p in PRESETS if a == args.arch)
        print(f"sao init-model: --preset {args.preset!r} unknown for {args.arch}; fix: use one of {known}", file=sys.stderr)
        return 2
    try:
        out = init_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype)
    except OSError as err:   # read-only, not a directory, no permission, full
        where = f" ({err.filename})" if err.filename and str(err.filename) != args.out_dir else ""
        print(f"sao init-model: cannot write {args.out_dir}: {err.strerror or err}{where}; fix: choose a writable "
              "directory", file=sys.stderr)
        return 2
    print(f"wrote {args.arch}/{args.preset} model and tokenizer to {out}")
    return 0
