"""SGLang 0.5.23's weight checksums (/weights_checker, action "checksum"), reproduced in our own code.

What SGLang computes (paths under sglang/srt/ of the 0.5.23 wheel):
- per tensor (utils/weight_checker.py `_hash_tensor`, managers/mm_utils.py `tensor_hash`): a 64-bit
  hash written as 16 lower-case hex digits. A CPU tensor hashes as the first 8 bytes (big-endian) of
  sha256 over its raw contiguous bytes; a CUDA tensor hashes with a triton kernel
  (sglang/kernels/ops/memory/gpu_tensor_hash.py), reproduced here by `gpu_words_hash`. So the same
  bytes give different checksums on CPU and on GPU: `tensor_checksums` returns both.
- per GPU (weight_checker.py `overall_checksum`): sha256 over the names in sorted order, each name's
  UTF-8 bytes followed by its hex checksum's bytes.
- per engine (managers/tokenizer_control_mixin.py `check_weights`): sha256 over the per-GPU
  checksums concatenated in reply order.
- skipped (weight_checker.py `_is_skip_weight_check`): names containing a non-persistent buffer
  pattern (rotary caches, inv_freq, ...) or any substring of the request's skip_tensor_list.

The reply (entrypoints/http_server.py `check_weights`; io_struct.py ChecksumInfo, ParallelismInfo):
``{"success", "message", "ranks": [{"checksums": {name: hex}, "per_gpu_checksum": hex,
"parallelism_info": [{role, tp_rank, tp_size, dp_rank, dp_size, pp_rank, pp_size, rank, size}]}],
"per_engine_checksum": hex}``; one ranks entry per TP rank of every DP replica
(scheduler_components/weight_updater.py `check_weights` gathers the TP group), one parallelism_info
per runner role ("target", and drafts whose names are prefixed with the role).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np
import torch

# utils/weight_checker.py _NON_PERSISTENT_BUFFER_PATTERNS
NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
PARALLELISM_FIELDS = ("role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank", "size")

_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
# constants of gpu_tensor_hash.py (murmur3 fmix32, position mixers, splitmix64 finaliser)
_FMIX_C1, _FMIX_C2, _POS_A, _POS_B = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2D, 0x165667B1
_SEED, _TILE_WORDS = 0x243F6A88, 8192


def is_skipped(name: str, skip_tensor_list: Optional[Iterable[str]] = None) -> bool:
    """True for the names SGLang leaves out of the checksum map."""
    return any(p in name for p in NON_PERSISTENT_PATTERNS) or any(p in name for p in (skip_tensor_list or ()))


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes in row-major order, as SGLang reads them (uint8 view, no conversion)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def cpu_checksum(data: np.ndarray) -> str:
    """SGLang's checksum of a CPU tensor: sha256 of the bytes, first 8 bytes as a 16-hex-digit number."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(data))).hexdigest()[:16]


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_FMIX_C1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(_FMIX_C2)
    return x ^ (x >> np.uint32(16))


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def gpu_words_hash(data: np.ndarray) -> int:
    """SGLang's triton tensor hash, computed on the CPU from the same bytes.

    The bytes are zero-padded to whole little-endian uint32 words w_i. Each word gives two 32-bit
    keys k1 = fmix32(w_i ^ ((i*A + s1) ^ rotl(i, 15))) and k2 likewise with (B, s2, 13); every tile of
    8192 words sums its keys mod 2^32, xors in the padded byte count and applies fmix32, giving the
    64-bit value (h1 << 32) | h2; the tile values are summed mod 2^64 and finished with splitmix64.
    An empty tensor hashes to 0. All arithmetic is uint32 / uint64 modular, as on the GPU.
    """
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, dtype=np.uint8)])
    words = raw.view("<u4").astype(np.uint32, copy=False)
    n = words.size
    if n == 0:
        return 0
    seed1, seed2 = _SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = np.uint32((n * 4) & _M32)
    total = 0
    for start in range(0, n, _TILE_WORDS * 64):        # bounded memory: 64 tiles at a time
        chunk = words[start:start + _TILE_WORDS * 64]
        idx = np.arange(start, start + chunk.size, dtype=np.uint64).astype(np.uint32)
        k1 = _fmix32(chunk ^ ((idx * np.uint32(_POS_A) + np.uint32(seed1)) ^ _rotl32(idx, 15)))
        k2 = _fmix32(chunk ^ ((idx * np.uint32(_POS_B) + np.uint32(seed2)) ^ _rotl32(idx, 13)))
        pad = -chunk.size % _TILE_WORDS                  # words past the end contribute nothing
        h1 = np.concatenate([k1, np.zeros(pad, np.uint32)]).reshape(-1, _TILE_WORDS).sum(axis=1, dtype=np.uint32)
        h2 = np.concatenate([k2, np.zeros(pad, np.uint32)]).reshape(-1, _TILE_WORDS).sum(axis=1, dtype=np.uint32)
        tiles = (_fmix32(h1 ^ nbytes).astype(np.uint64) << np.uint64(32)) | _fmix32(h2 ^ nbytes).astype(np.uint64)
        total = (total + int(tiles.sum(dtype=np.uint64))) & _M64
    return _splitmix64(total)


def gpu_checksum(data: np.ndarray) -> str:
    """SGLang's checksum of a CUDA tensor with these bytes (16 hex digits)."""
    return f"{gpu_words_hash(data):016x}"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The checksum SGLang reports for this tensor where it lives (CUDA: triton hash, else sha256)."""
    data = tensor_bytes(tensor)
    return gpu_checksum(data) if tensor.is_cuda else cpu_checksum(data)


def tensor_checksums(tensor: torch.Tensor) -> dict[str, str]:
    """Both checksums of the tensor's bytes: {"cpu": ..., "gpu": ...}, for an engine on either device."""
    data = tensor_bytes(tensor)
    return {"cpu": cpu_checksum(data), "gpu": gpu_checksum(data)}


def overall_checksum(checksums: dict[str, str]) -> str:
    """The per-GPU checksum over a {name: hex} map (sorted names, name bytes then hex bytes)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(per_gpu_checksums: Iterable[str]) -> str:
    """The per-engine checksum: sha256 of the per-GPU checksums in reply order."""
    h = hashlib.sha256()
    for value in per_gpu_checksums:
        h.update(value.encode())
    return h.hexdigest()


def checksum_reply(per_rank: list[dict[str, str]]) -> dict:
    """SGLang's success body for action "checksum" from one {name: hex} map per TP rank (target
    runner only, one DP replica, one pipeline stage)."""
    size = len(per_rank)
    ranks = [{"checksums": sums, "per_gpu_checksum": overall_checksum(sums),
              "parallelism_info": [{"role": "target", "tp_rank": i, "tp_size": size, "dp_rank": 0, "dp_size": 1,
                                    "pp_rank": 0, "pp_size": 1, "rank": i, "size": size}]}
             for i, sums in enumerate(per_rank)]
    return {"success": True, "message": "Success.", "ranks": ranks,
            "per_engine_checksum": engine_checksum(r["per_gpu_checksum"] for r in ranks)}


@dataclass
class RankChecksums:
    """One GPU (TP rank of one DP replica) of an engine: its {name: hex} map and where it sits."""

    checksums: dict[str, str]
    per_gpu_checksum: str
    parallelism_info: list[dict] = field(default_factory=list)

    @property
    def placement(self) -> tuple[int, int, int, int]:
        """(pp_rank, pp_size, tp_rank, tp_size) of the target runner (the first role)."""
        info = self.parallelism_info[0] if self.parallelism_info else {}
        return (info.get("pp_rank", 0), info.get("pp_size", 1), info.get("tp_rank", 0), info.get("tp_size", 1))


@dataclass
class EngineChecksums:
    """A parsed /weights_checker reply. `ranks` is empty for actions other than "checksum"."""

    message: str
    ranks: list[RankChecksums] = field(default_factory=list)
    per_engine_checksum: Optional[str] = None


def parse_weights_checker_reply(data: Any) -> EngineChecksums:
    """Check one /weights_checker reply field by field; ValueError names the first bad field. The
    per-GPU and per-engine checksums are recomputed, so a reply that is not self-consistent fails."""
    if not isinstance(data, dict):
        raise ValueError(f"reply is {type(data).__name__}, expected a JSON object")
    if data.get("success") is not True:
        raise ValueError(f"'success' is {data.get('success')!r}: {data.get('message', '')}")
    if not isinstance(data.get("message"), str):
        raise ValueError("'message' missing or not a string")
    if "ranks" not in data and "per_engine_checksum" not in data:
        return EngineChecksums(message=data["message"])
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("'ranks' missing or not a non-empty list")
    parsed = [_parse_rank(r, i) for i, r in enumerate(ranks)]
    per_engine = data.get("per_engine_checksum")
    if not isinstance(per_engine, str):
        raise ValueError("'per_engine_checksum' missing or not a string")
    if per_engine != engine_checksum(r.per_gpu_checksum for r in parsed):
        raise ValueError("'per_engine_checksum' is not sha256 of the ranks' per_gpu_checksum values")
    return EngineChecksums(message=data["message"], ranks=parsed, per_engine_checksum=per_engine)


def _parse_rank(rank: Any, i: int) -> RankChecksums:
    where = f"ranks[{i}]"
    if not isinstance(rank, dict):
        raise ValueError(f"'{where}' is not an object")
    sums = rank.get("checksums")
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise ValueError(f"'{where}.checksums' missing or not a {{name: hex string}} object")
    if not isinstance(rank.get("per_gpu_checksum"), str):
        raise ValueError(f"'{where}.per_gpu_checksum' missing or not a string")
    if rank["per_gpu_checksum"] != overall_checksum(sums):
        raise ValueError(f"'{where}.per_gpu_checksum' does not match its checksums (sha256 over sorted names)")
    infos = rank.get("parallelism_info")
    if not isinstance(infos, list) or not infos:
        raise ValueError(f"'{where}.parallelism_info' missing or not a non-empty list")
    for j, info in enumerate(infos):
        missing = [k for k in PARALLELISM_FIELDS if not isinstance(info, dict) or k not in info]
        if missing:
            raise ValueError(f"'{where}.parallelism_info[{j}]' lacks {', '.join(missing)}")
    return RankChecksums(checksums=dict(sums), per_gpu_checksum=rank["per_gpu_checksum"], parallelism_info=infos)
