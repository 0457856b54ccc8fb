"""A single-process run binds its rendezvous store to a port the kernel picks while binding: a port
chosen earlier and taken by another process in between (seen in CI: "cannot listen on 127.0.0.1:N
(Address already in use)") cannot fail the run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = r'''
import os, socket
os.environ.pop("MASTER_PORT", None)
from parallel.distributed import init_distributed, single_process_port
single_process_port()
chosen = int(os.environ["MASTER_PORT"])
thief = socket.socket()
thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
thief.bind(("127.0.0.1", chosen))
thief.listen()
init_distributed("gloo")
import torch.distributed as dist
print("RESULT", chosen, os.environ["MASTER_PORT"], dist.get_world_size())
'''


def test_a_single_rank_run_survives_its_chosen_port_being_taken():
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE",
                                                                                  "LOCAL_RANK", "SLURM_", "OMPI_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line, out.stderr[-800:]
    _, chosen, used, world = line[0].split()
    assert used != chosen and int(used) > 0 and world == "1"
