"""`sao convert hf-to-mcore HF_DIR OUT_DIR --tp --ep --pp --vpp`, `sao convert mcore-to-hf MCORE_DIR OUT_DIR`
and `sao convert hf-to-fp8 HF_DIR OUT_DIR` (the block-FP8 checkpoint FP8 engines load:
rollout/weights/fp8_checkpoint.py).

Offline conversion between an HF safetensors directory and per-rank Megatron (local spec) shards
(checkpoints/mcore_io.py describes the directory). The mapping is checkpoints/convert.py; the round
trip is bit-exact.
"""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    parser = sub.add_parser("convert", help="Convert checkpoints between HF and Megatron shards")
    kinds = parser.add_subparsers(dest="direction", required=True)
    to_mcore = kinds.add_parser("hf-to-mcore", help="HF directory -> every rank's Megatron shards")
    to_mcore.add_argument("hf_dir", help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("out_dir", help="directory to write (sao_mcore.json, shards/, hf/)")
    sizes = (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline"), ("vpp", "virtual pipeline (per pp rank)"))
    for flag, doc in sizes:
        to_mcore.add_argument(f"--{flag}", type=int, default=1, help=f"{doc} parallel size")
    to_mcore.add_argument("--etp", type=int, default=0, help="expert tensor parallel size (0 = tp)")
    to_mcore.add_argument("--last-stage-layers", type=int, default=0,
                          help="layers on the last pipeline rank (the recipe's parallel.last_stage_layers; 0 = even)")
    to_mcore.add_argument("--padded-vocab", type=int, default=0,
                          help="padded vocabulary rows (0 = the trainer's rule: a multiple of 128, or 128*tp)")
    to_mcore.add_argument("--arch", default="", help="architecture (default: config.json model_type)")
    to_hf = kinds.add_parser("mcore-to-hf", help="Megatron shards written by hf-to-mcore -> HF directory")
    to_hf.add_argument("mcore_dir", help="directory written by `sao convert hf-to-mcore`")
    to_hf.add_argument("out_dir", help="HF directory to write (safetensors shards + index, config, tokenizer)")
    to_hf.add_argument("--max-shard-mb", type=float, default=4096, help="largest safetensors file")
    to_fp8 = kinds.add_parser("hf-to-fp8", help="HF directory -> block-FP8 (128x128) checkpoint for FP8 engines "
                                                 "(rollout.engine_model_path with rollout.engine_fp8)")
    to_fp8.add_argument("hf_dir", help="unquantized HF model directory")
    to_fp8.add_argument("out_dir", help="new directory to write")
    to_fp8.add_argument("--ignore", action="append", default=[],
                        help="module to leave unquantized (modules_to_not_convert), e.g. model.layers.0.mlp; repeatable")
    to_fp8.add_argument("--max-shard-mb", type=float, default=4096, help="largest safetensors file")
    parser.set_defaults(func=run)


def run(args) -> int:
    from safetensors import SafetensorError

    from checkpoints.layout import ShardLayout
    from checkpoints.mcore_io import mcore_dir_to_hf, save_mcore_dir

    try:
        check_arguments(args)
        if args.direction == "hf-to-mcore":
            check_config_matches_weights(args.hf_dir, args.arch)
            layout = ShardLayout(tp_size=args.tp, ep_size=args.ep, pp_size=args.pp, vpp_size=args.vpp,
                                 etp_size=args.etp, padded_vocab_size=args.padded_vocab or _trainer_padding(args))
            out = save_mcore_dir(args.hf_dir, args.out_dir, layout, arch=args.arch)
        elif args.direction == "hf-to-fp8":
            from rollout.weights.fp8_checkpoint import write_block_fp8_checkpoint

            out = write_block_fp8_checkpoint(args.hf_dir, args.out_dir, tuple(args.ignore), args.max_shard_mb)
        else:
            out = mcore_dir_to_hf(args.mcore_dir, args.out_dir, max_shard_mb=args.max_shard_mb)
    except json.JSONDecodeError as err:   # a config.json or index that is not JSON: name the directory
        source = getattr(args, "hf_dir", None) or args.mcore_dir
        print(f"sao convert {args.direction}: a JSON file in {source} does not parse ({err}); fix: restore its "
              "config.json / index", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        print(f"sao convert {args.direction}: {err}", file=sys.stderr)
        return 2
    except SafetensorError as err:   # a corrupt file, or a header whose offsets pass the file's end
        source = getattr(args, "hf_dir", None) or args.mcore_dir
        print(f"sao convert {args.direction}: {source} holds a safetensors file that does not read ({err}); fix: "
              "copy or export the checkpoint again", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def check_arguments(args) -> None:
    """Sizes, limits and paths before any file is read or written (a --tp 0 used to divide by zero)."""
    check_output_apart_from_input(getattr(args, "hf_dir", None) or args.mcore_dir, args.out_dir)
    if args.direction == "hf-to-mcore":
        for flag in ("tp", "ep", "pp", "vpp"):
            value = getattr(args, flag)
            if value < 1:
                raise ValueError(f"--{flag} {value}: a parallel size is at least 1; fix: pass --{flag} 1 or more")
        for flag, value in (("etp", args.etp), ("padded-vocab", args.padded_vocab)):
            if value < 0:
                raise ValueError(f"--{flag} {value} is negative; fix: pass 0 (the default rule) or more")
    elif not 0 < args.max_shard_mb < float("inf"):
        raise ValueError(f"--max-shard-mb {args.max_shard_mb}: fix: pass a positive size in MiB (e.g. 4096)")


def check_output_apart_from_input(source: str, out: str) -> None:
    """An output inside its input (`sao convert hf-to-mcore M M`) writes shards among the weights it reads,
    and an input inside its output is overwritten by the conversion: both are refused."""
    from pathlib import Path

    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"output {out} and input {source} overlap; fix: write to a new directory outside the input")


def check_config_matches_weights(hf_dir: str, arch: str = "") -> None:
    """Every tensor the conversion needs, with the shape config.json implies, read from the
    safetensors headers before anything is written (checkpoints/hf_shapes.py)."""
    from checkpoints.arch import spec_from_hf_config
    from checkpoints.hf_io import HFCheckpoint
    from checkpoints.hf_shapes import check_hf_shapes, header_shapes

    hf = HFCheckpoint(hf_dir)
    cfg = hf.config()
    check_hf_shapes(header_shapes(hf), spec_from_hf_config(cfg, arch), cfg)


def _trainer_padding(args) -> int:
    """The padded vocabulary the trainer builds (parallel/specs.py), so shards load as they are."""
    from checkpoints.arch import spec_from_hf_dir
    from parallel.specs import padded_vocab_size

    return padded_vocab_size(spec_from_hf_dir(args.hf_dir, args.arch).vocab_size, args.tp)
