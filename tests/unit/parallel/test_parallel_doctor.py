"""`sao doctor`: environment report, layout choice and the tolerance verdict."""
from __future__ import annotations

from sao_megatron.cli import doctor
from sao_megatron.cli.main import main


def test_environment_only(capsys):
    assert main(["doctor", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    for key in ("torch", "cuda", "megatron-core", "transformer_engine", "sglang"):
        assert f"{key}:" in out
    assert "0.16.1" in out


def test_layout_that_does_not_fit_is_rejected(capsys):
    assert main(["doctor", "--world-size", "2", "--layouts", "tp2xep2"]) == 2
    assert "do not fit 2 ranks" in capsys.readouterr().err


def test_tolerance_verdict():
    good = {"logp": 1e-6, "loss": 5e-7, "grad_norm": 1e-5}
    assert doctor.within(good, grad_scale=2.0)
    assert not doctor.within({**good, "loss": 1e-3}, grad_scale=2.0)
    assert not doctor.within({**good, "grad_norm": 1e-3}, grad_scale=2.0)
