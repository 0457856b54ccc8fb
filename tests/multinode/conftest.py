"""Fixtures of the multi-node tier (helpers in multinode_cluster.py): the cluster of
.ci/multinode_setup.sh or a skip naming why not, and the tiny model the engines load."""
from __future__ import annotations

import subprocess
import sys

import pytest

from multinode_cluster import cluster_problem


@pytest.fixture(scope="session")
def cluster():
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def tiny_model(cluster, tmp_path):
    """The tiny model at the recipe's path under the job's workdir: engines on their own node start
    before the trainer would create it."""
    out = tmp_path / "runs" / "models" / "tiny_qwen3_moe"
    subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "init-model", "--arch", "qwen3_moe", "--preset",
                    "tiny", "--seed", "1", str(out)], check=True, capture_output=True, timeout=300)
    return out

