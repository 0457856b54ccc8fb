"""Rollout engines: the client the trainer talks to (SGLang's HTTP protocol), the launcher and health checks,
the reference server that speaks the same protocol on CPU, and the decoders of what engines return
(routed experts, indexer top-k).
"""
