"""`sao convert hf-to-mcore` then `sao convert mcore-to-hf` give back the HF tensors bit for bit."""
from __future__ import annotations

import json

import torch

from checkpoints.hf_io import HFCheckpoint
from sao_megatron.cli.main import main


def test_cli_round_trip_tp2_ep2_pp2(tiny_model_dir, tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "hf-to-mcore", str(tiny_model_dir), str(mcore), "--tp", "2", "--ep", "2", "--pp", "2"]) == 0
    meta = json.loads((mcore / "sao_mcore.json").read_text())
    assert len(meta["files"]) == 8 and meta["layout"]["padded_vocab_size"] == 128
    shard = torch.load(mcore / "shards/pp1_tp1_ep1.pt", weights_only=True)
    assert shard[0]["output_layer.weight"].shape == (64, 64)          # 128 padded rows / tp 2
    assert main(["convert", "mcore-to-hf", str(mcore), str(back)]) == 0
    src, out = HFCheckpoint(tiny_model_dir), HFCheckpoint(back)
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)
    assert (back / "config.json").is_file() and (back / "tokenizer.json").is_file()


def test_cli_refuses_bad_layout_and_corrupt_shard(tiny_model_dir, tmp_path, capsys):
    assert main(["convert", "hf-to-mcore", str(tiny_model_dir), str(tmp_path / "x"), "--pp", "3"]) == 2
    assert "pp=3" in capsys.readouterr().err
    mcore = tmp_path / "m"
    assert main(["convert", "hf-to-mcore", str(tiny_model_dir), str(mcore), "--ep", "2"]) == 0
    shard = mcore / "shards/pp0_tp0_ep1.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    capsys.readouterr()
    assert main(["convert", "mcore-to-hf", str(mcore), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "pp0_tp0_ep1.pt" in err and "checksum" in err and err.count("\n") == 1
