"""What the route handlers of one reference server share (built by server.build_state)."""
from __future__ import annotations

import concurrent.futures
import os
from typing import Optional

from .gate import UpdateGate
from .scheduler import Scheduler
from .tp_ranks import TPRanks
from .weights import WeightMap

# SGLang's server status (managers/tokenizer_manager.py:718 Starting until the warmup generate
# answers, entrypoints/http_server.py:2502 Up; :798 UnHealthy after a failed /health).
STARTING, UP, UNHEALTHY = "Starting", "Up", "UnHealthy"


def health_check_timeout_s() -> int:
    """SGLang's HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20)) (http_server.py:218)."""
    raw = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"SGLANG_HEALTH_CHECK_TIMEOUT={raw!r} is not an integer number of seconds; "
                         "unset it (20 s) or set e.g. 5") from None


class ServerState:
    """The scheduler, the weight map, the gate in front of the scheduler, the weight-update groups
    and session, the TP ranks and one worker thread for group formation and broadcast receives."""

    def __init__(self, scheduler: Scheduler, tokenizer, api_key: str, weight_sync_timeout_s: float,
                 tp: int = 1, insecure: bool = False):
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.weights = WeightMap(self.runner.model)
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.insecure = insecure                        # no key: serve the control routes anyway
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.gate = UpdateGate()
        self.status = STARTING
        self.exiting = False
        self.health_timeout_s = health_check_timeout_s()
        self.model_path = self.runner.model_dir        # moved by a disk update, as SGLang's /model_info
        self.load_format = "auto"
        self.groups: dict[str, object] = {}
        self.session: Optional[str] = None              # the selector of the open weight-update session
        self.flush_pending = False
        self.disk_read: Optional[str] = None            # the model_path a disk update is still reading
        self.in_flight: set[str] = set()                # rids of /generate requests not yet answered
        self.tp_ranks = TPRanks(tp, weight_sync_timeout_s)
        # one thread for group formation and broadcast receives, so they keep the trainer's order
        # and never block generation (only the final in-place copy runs on the scheduler thread)
        self.transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sao-weights")
        eos = self.runner.config.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
