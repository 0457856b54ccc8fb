"""SIGTERM / SIGUSR1 set the checkpoint-and-exit flag; a subprocess trainer checkpoints and exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from checkpoints import preemption


pytestmark = pytest.mark.usefixtures("preemption_signals_restored")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_without_exiting(sig):
    preemption.install_preemption_handlers()
    assert not preemption.should_checkpoint_and_exit()
    os.kill(os.getpid(), sig)       # delivered to the main thread before the next bytecode
    assert preemption.should_checkpoint_and_exit()
    assert preemption.received_signals() == [sig.name]


TRAINER = textwrap.dedent("""
    import sys, time
    from checkpoints.preemption import install_preemption_handlers, should_checkpoint_and_exit
    from checkpoints.run_state import RunCheckpointer, ValueState
    state = {"step": 0}
    install_preemption_handlers()
    ckpt = RunCheckpointer(sys.argv[1])
    print("ready", flush=True)
    for _ in range(100000):
        state["step"] += 1                  # one 'training step'
        time.sleep(0.01)
        if should_checkpoint_and_exit():    # the safe point
            ckpt.save(state["step"], {"trainer": ValueState(lambda: state, state.update)})
            print("saved", state["step"], flush=True)
            sys.exit(0)
    sys.exit(3)
""")


def test_subprocess_trainer_checkpoints_and_exits_cleanly_on_sigusr1(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    step = int(out.split()[-1])
    assert (tmp_path / "latest").read_text() == f"step_{step:08d}"
