"""Offline Megatron shard directories (what `sao convert` writes and reads).

Layout of a directory written by `save_mcore_dir`::

    sao_mcore.json                  {"format": "sao-mcore-v1", "arch", "layout": {tp, ep, pp, vpp, etp,
                                     padded_vocab_size}, "files": {shard: sha256}}
    hf/                             config.json, tokenizer and generation files of the source model
    shards/pp{p}_tp{t}_ep{e}.pt     torch.save of that rank's state dicts, one per virtual chunk

Each shard is exactly what `checkpoints.convert.hf_to_mcore` returns for that rank, i.e. what a
local-spec GPTModel chunk accepts in `load_state_dict` (tests/distributed/test_convert_megatron.py).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from sao_megatron.core.shape import shape_from_hf

from .arch import spec_from_hf_config
from .convert import hf_to_mcore, iter_mcore_to_hf
from .hf_io import HFCheckpoint, copy_aux_files, save_hf_checkpoint
from .layout import ShardLayout, all_layouts
from .manifest import CheckpointCorruptError, sha256_file

FORMAT = "sao-mcore-v1"
LAYOUT_KEYS = ("tp_size", "ep_size", "pp_size", "vpp_size", "etp_size", "padded_vocab_size", "last_stage_layers")


def _shard_name(layout: ShardLayout) -> str:
    return f"shards/pp{layout.pp_rank}_tp{layout.tp_rank}_ep{layout.ep_rank}.pt"


def save_mcore_dir(hf_dir: str | Path, out_dir: str | Path, layout: ShardLayout, arch: str = "") -> Path:
    """Convert an HF directory into every rank's shards of `layout` (rank fields of `layout` ignored)."""
    hf = HFCheckpoint(hf_dir)
    cfg = hf.config()
    spec = spec_from_hf_config(cfg, arch)
    dims = layout.dims()
    dims.validate(dims.world_size, replace(shape_from_hf(cfg, spec.arch), mla=spec.mla))  # LayoutError names the size
    _check_names(hf, spec)
    out = Path(out_dir)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "hf").mkdir(exist_ok=True)
    copy_aux_files(hf_dir, out / "hf")
    base = {k: getattr(layout, k) for k in LAYOUT_KEYS}
    files = {}
    for rank in all_layouts(tp=layout.tp_size, ep=layout.ep_size, pp=layout.pp_size, vpp=layout.vpp_size,
                            etp_size=layout.etp_size, padded_vocab_size=layout.padded_vocab(spec.vocab_size),
                            last_stage_layers=layout.last_stage_layers):
        torch.save(hf_to_mcore(hf, spec, rank), out / _shard_name(rank))
        files[_shard_name(rank)] = sha256_file(out / _shard_name(rank))
    base["padded_vocab_size"] = layout.padded_vocab(spec.vocab_size)
    meta = {"format": FORMAT, "arch": spec.arch, "layout": base, "files": files}
    (out / "sao_mcore.json").write_text(json.dumps(meta, indent=1))
    return out


def _check_names(hf: HFCheckpoint, spec) -> None:
    from .name_map import expected_hf_names

    extra = sorted(set(hf) - expected_hf_names(spec))
    if extra:
        raise ValueError(f"{len(extra)} HF tensors have no Megatron mapping for {spec.arch}, e.g. {extra[0]} "
                         "(multi-token-prediction layers are not converted); "
                         "fix: remove them or extend checkpoints/name_map.py")


def load_mcore_dir(mcore_dir: str | Path) -> tuple[dict, dict]:
    """(meta, {ShardLayout: chunks}) after checking every shard's checksum."""
    root = Path(mcore_dir)
    meta_path = root / "sao_mcore.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found; "
                                "fix: point at a directory written by `sao convert hf-to-mcore`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    lay = meta["layout"]
    shards = {}
    for rank in all_layouts(tp=lay["tp_size"], ep=lay["ep_size"], pp=lay["pp_size"], vpp=lay["vpp_size"],
                            etp_size=lay["etp_size"], padded_vocab_size=lay["padded_vocab_size"],
                            last_stage_layers=lay.get("last_stage_layers", 0)):   # older dirs: even split
        path = root / _shard_name(rank)
        if not path.is_file() or sha256_file(path) != meta["files"].get(_shard_name(rank)):
            raise CheckpointCorruptError(f"shard {path} is missing or does not match its checksum in {meta_path}")
        shards[rank] = torch.load(path, map_location="cpu", weights_only=True)
    return meta, shards


def mcore_dir_to_hf(mcore_dir: str | Path, out_dir: str | Path, max_shard_mb: float = 4096) -> Path:
    """Merge every rank's shards back into an HF safetensors directory loadable by transformers/SGLang."""
    root = Path(mcore_dir)
    meta, shards = load_mcore_dir(root)
    cfg = json.loads((root / "hf" / "config.json").read_text())
    spec = spec_from_hf_config(cfg, meta["arch"])
    return save_hf_checkpoint(out_dir, iter_mcore_to_hf(shards, spec), aux_from=root / "hf", max_shard_mb=max_shard_mb)


__all__ = ["save_mcore_dir", "load_mcore_dir", "mcore_dir_to_hf"]
