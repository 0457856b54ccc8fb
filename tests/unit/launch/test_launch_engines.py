"""launch.engines.wait_ready: healthy engines, a missing one (named at the timeout), a dead engine step."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from sao_megatron.core.ports import free_port
from launch.engines import main, wait_ready


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def healthy_url():
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_returns_when_every_engine_is_healthy(healthy_url):
    wait_ready([healthy_url, healthy_url + "/"], timeout_s=30)
    assert main(["wait", "--timeout", "30", healthy_url]) == 0


def test_names_the_engine_that_never_answered(healthy_url):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(RuntimeError, match=f"not healthy after 0s: {dead}"):
        wait_ready([healthy_url, dead], timeout_s=0.0, poll_s=0.01)


def test_a_dead_engine_step_fails_at_once():
    pid = subprocess.Popen([sys.executable, "-c", "pass"]).pid
    os.waitpid(pid, 0)  # reaped: the pid no longer exists
    unreachable = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(RuntimeError, match=rf"engine step\(s\) \[{pid}\] exited"):
        wait_ready([unreachable], timeout_s=3600, watch_pids=(pid,))
