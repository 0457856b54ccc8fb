"""Metric sinks (wandb / jsonl / console) and the curves plot."""
from .sinks import ConsoleSink, JsonlSink, MetricSink, MultiSink, WandbSink, build_metric_sink

__all__ = ["ConsoleSink", "JsonlSink", "MetricSink", "MultiSink", "WandbSink", "build_metric_sink"]
