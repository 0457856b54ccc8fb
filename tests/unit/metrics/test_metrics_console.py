"""The run's console (sao_megatron/metrics/console.py): plain lines off a terminal, with tokens/s and the
time left; start-up phases; Megatron's missing-TE/Apex warnings hidden in a run."""
from __future__ import annotations

import io
import warnings

import pytest

from sao_megatron.metrics.console import ConsoleSink, StartupPhases, quiet_missing_kernel_warnings


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_step_lines_carry_tokens_per_s_and_the_time_left():
    stream = io.StringIO()
    sink = ConsoleSink(10, stream=stream)
    sink.log({"perf/step_time_s": 2.0, "perf/tokens_per_s": 1234.4, "train/ref_kl": 0.0012}, 1)
    sink.log({"perf/step_time_s": 4.0, "perf/tokens_per_s": 1000.0}, 2)
    sink.close()
    first, second = stream.getvalue().splitlines()
    assert "1/10" in first and "tok/s 1234" in first and "kl 0.0012" in first and "left 18s" in first  # 9 x 2 s
    assert "left 24s" in second   # mean(2, 4) x 8 steps
    assert "\x1b[" not in stream.getvalue()   # no terminal control codes in a log


def test_time_left_needs_a_step_and_counts_minutes_and_hours():
    sink = ConsoleSink(1000, stream=io.StringIO())
    assert sink.seconds_left(1) is None
    sink.log({"perf/step_time_s": 12.5}, 1)
    assert "left 3h28m" in sink.line({}, 1)     # 999 x 12.5 s = 12487.5 s
    sink.log({"perf/step_time_s": 12.5}, 995)
    assert "left 1m02s" in sink.line({}, 995)   # 5 x 12.5 s


def test_rich_draws_only_when_stdout_and_the_stream_are_terminals(monkeypatch):
    monkeypatch.setattr("sys.stdout", Terminal())
    stream = Terminal()
    sink = ConsoleSink(4, stream=stream)
    sink.log({"perf/step_time_s": 1.0, "perf/tokens_per_s": 50.0}, 1)
    sink.close()
    assert sink.tty and "tok/s 50" in stream.getvalue()
    monkeypatch.setattr("sys.stdout", io.StringIO())   # stdout redirected: plain lines even on a terminal
    assert not ConsoleSink(4, stream=Terminal()).tty


def test_startup_phases_print_plain_lines_with_their_seconds():
    stream = io.StringIO()
    phases = StartupPhases(stream=stream)
    with phases.phase("building models"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "sao: building models ..." and lines[1].startswith("sao: building models done (")
    quiet = io.StringIO()
    with StartupPhases(enabled=False, stream=quiet).phase("starting engines"):
        pass
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("text", [
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Apex is not installed. Falling back to Torch Norm",
])
def test_megatrons_missing_kernel_warnings_are_hidden_in_a_run(text):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_missing_kernel_warnings()
        warnings.warn(text, UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
    assert [str(w.message) for w in caught] == ["an unrelated warning"]


def test_a_gpu_run_without_transformer_engine_gets_one_line_a_cpu_run_none(monkeypatch):
    import importlib.util

    from sao_megatron.metrics.console import missing_kernels_note

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_kernels_note(cuda=False) == ""
    note = missing_kernels_note(cuda=True)
    assert "Transformer Engine is not installed" in note and "sao doctor" in note and "\n" not in note
    stream = io.StringIO()
    StartupPhases(stream=stream).note(note)
    StartupPhases(enabled=False, stream=stream).note(note)
    assert stream.getvalue() == note + "\n"
