"""The one list of benchmarks: each has a module bench/NAME.py with ``run(quick, ...) -> dict``, a
results file NAME.json and a section of the report. Adding a benchmark is one entry here.

BENCHMARKS is in the order docs/results.md shows them (what the algorithm learns first, then the
systems numbers); RUN_ORDER is the order `sao bench all` runs them (quick systems benchmarks first, so
a broken setup fails in minutes, the long training runs last).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bench import packing
from bench import report_learning as learning
from bench import report_stability
from bench import report_systems as systems
from bench import weight_sync_sharded


@dataclass(frozen=True)
class Benchmark:
    name: str                          # `sao bench NAME`, module bench/NAME.py, OUT_DIR/NAME.json
    title: str                         # its section heading in the report
    section: Callable[[dict, Callable], str]   # (result, link) -> the section's markdown


BENCHMARKS = (
    Benchmark("demo", "The tiny demo", learning.demo_section),
    Benchmark("algorithms", "Algorithms at equal sample budget", learning.algorithms_section),
    Benchmark("online", "Online learning", learning.online_section),
    Benchmark("stability", "Stability", report_stability.stability_section),
    Benchmark("pipeline", "Async single-rollout pipeline vs synchronous group pipeline", systems.pipeline_section),
    Benchmark("weight_sync", "Weight sync vs raw broadcast", systems.weight_sync_section),
    Benchmark("weight_sync_sharded", "Shard writes (each engine TP rank receives its slice) vs raw transports",
              weight_sync_sharded.section),
    Benchmark("engine", "Reference server vs HF `generate`", systems.engine_section),
    Benchmark("parallel", "Parallel layouts", systems.parallel_section),
    Benchmark("packing", "Packed vs padded micro-batches", packing.section),
)

RUN_ORDER = ("demo", "engine", "pipeline", "weight_sync", "weight_sync_sharded", "parallel", "packing", "algorithms",
             "stability", "online")
