"""SGLang 0.5.23's weight checksums reproduced (rollout/weights/checksum.py): hand-computed vectors
with hashlib, the triton hash against a word-by-word transliteration of its kernel, and the reply
parser's one-line errors naming the field."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from rollout.weights.checksum import (checksum_reply, cpu_checksum, engine_checksum, gpu_checksum, is_skipped,
                                     overall_checksum, parse_weights_checker_reply, tensor_bytes, tensor_checksum,
                                     tensor_checksums)

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1


def test_cpu_checksum_is_the_first_8_sha256_bytes_of_the_raw_bytes():
    t = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    raw = struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)
    want = f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"
    assert tensor_checksum(t) == want == cpu_checksum(tensor_bytes(t))
    # the bytes as stored, never converted: bf16 1.0 is 0x3f80, little-endian
    assert tensor_checksum(torch.tensor([1.0], dtype=torch.bfloat16)) == hashlib.sha256(b"\x80\x3f").hexdigest()[:16]
    # row-major bytes of a non-contiguous view, as SGLang's .contiguous() reads them
    assert tensor_checksum(t.t()) == hashlib.sha256(struct.pack("<4f", 1.0, 0.5, -2.0, 3.0)).hexdigest()[:16]


def test_overall_and_engine_checksums_hand_computed():
    assert overall_checksum({"b.w": "02", "a.w": "01"}) == hashlib.sha256(b"a.w01b.w02").hexdigest()
    assert engine_checksum(["x1", "y2"]) == hashlib.sha256(b"x1y2").hexdigest()
    assert overall_checksum({}) == hashlib.sha256(b"").hexdigest()


def _fmix(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & M32


def _kernel_by_words(data: bytes) -> int:
    """gpu_tensor_hash.py read word by word: per 8192-word tile two sums of position-mixed fmix32 keys,
    xor byte count, fmix32; tiles summed mod 2^64; splitmix64."""
    data += b"\0" * (-len(data) % 4)
    words = struct.unpack(f"<{len(data) // 4}I", data)
    if not words:
        return 0
    seed = 0x243F6A88
    s1, s2 = seed & M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    total = 0
    for base in range(0, len(words), 8192):
        h1 = h2 = 0
        for i in range(base, min(base + 8192, len(words))):
            h1 = (h1 + _fmix(words[i] ^ (((i * 0x27D4EB2D + s1) & M32) ^ _rotl(i, 15)))) & M32
            h2 = (h2 + _fmix(words[i] ^ (((i * 0x165667B1 + s2) & M32) ^ _rotl(i, 13)))) & M32
        nbytes = (len(words) * 4) & M32
        total = (total + ((_fmix(h1 ^ nbytes) << 32) | _fmix(h2 ^ nbytes))) & M64
    x = total
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


@pytest.mark.parametrize("nbytes", [0, 1, 6, 4 * 8192, 4 * 8192 + 10, 3 * 4 * 8192 + 2])
def test_gpu_hash_matches_the_kernel_read_word_by_word(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert gpu_checksum(data) == f"{_kernel_by_words(data.tobytes()):016x}"


def test_gpu_hash_of_one_word_by_hand():
    # one word w=1 at index 0: keys fmix32(1 ^ seed_j) (the position terms vanish at i = 0), one tile
    # xor 4 bytes then fmix32, packed as h1 << 32 | h2, then splitmix64
    s1, s2 = 0x243F6A88, ((0x243F6A88 * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    x = (_fmix(_fmix(1 ^ s1) ^ 4) << 32) | _fmix(_fmix(1 ^ s2) ^ 4)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    assert gpu_checksum(np.array([1, 0, 0, 0], dtype=np.uint8)) == f"{x ^ (x >> 31):016x}"
    assert gpu_checksum(np.array([1], dtype=np.uint8)) == gpu_checksum(np.array([1, 0, 0, 0], dtype=np.uint8))


def test_tensor_checksums_gives_both_kinds_and_cpu_tensors_use_sha256():
    t = torch.arange(10, dtype=torch.float32)
    both = tensor_checksums(t)
    assert both["cpu"] == tensor_checksum(t) and both["gpu"] == gpu_checksum(tensor_bytes(t)) != both["cpu"]


def test_skipped_names_follow_sglang_patterns_and_the_skip_list():
    assert is_skipped("model.rotary_emb.inv_freq") and is_skipped("model.rotary_emb.original_inv_freq")
    assert is_skipped("x.cos_sin_cache") and not is_skipped("model.norm.weight")
    assert is_skipped("model.layers.0.mlp.gate.weight", ["mlp.gate"])


def _good_reply():
    return checksum_reply([{"a.weight": "00000000000000aa", "b.weight": "00000000000000bb"}])


def test_reply_parses_and_is_self_consistent():
    parsed = parse_weights_checker_reply(_good_reply())
    assert parsed.message == "Success." and len(parsed.ranks) == 1
    assert parsed.ranks[0].placement == (0, 1, 0, 1) and parsed.ranks[0].checksums["a.weight"].endswith("aa")
    assert parse_weights_checker_reply({"success": True, "message": "Success."}).ranks == []


def _broken(edit):
    reply = _good_reply()
    edit(reply)
    return reply


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.update(success=False, message="Unsupported action='x'"), "'success' is False: Unsupported"),
    (lambda r: r.pop("message"), "'message'"),
    (lambda r: r.update(ranks={}), "'ranks'"),
    (lambda r: r.pop("per_engine_checksum"), "'per_engine_checksum' missing"),
    (lambda r: r.update(per_engine_checksum="00"), "'per_engine_checksum' is not sha256"),
    (lambda r: r["ranks"][0].update(checksums={"a": 1}), "'ranks[0].checksums'"),
    (lambda r: r["ranks"][0].update(per_gpu_checksum="ff"), "'ranks[0].per_gpu_checksum' does not match"),
    (lambda r: r["ranks"][0]["parallelism_info"][0].pop("tp_size"), "'ranks[0].parallelism_info[0]' lacks tp_size"),
    (lambda r: r["ranks"].__setitem__(0, "x"), "'ranks[0]' is not an object"),
])
def test_malformed_reply_names_the_field(edit, field):
    with pytest.raises(ValueError) as err:
        parse_weights_checker_reply(_broken(edit))
    assert field in str(err.value) and "\n" not in str(err.value)
