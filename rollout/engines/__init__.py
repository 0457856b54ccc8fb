"""Rollout engines: the `Generator` role (engine.py), the client the trainer talks to (SGLang's HTTP protocol,
sglang_client.py), the launcher and its flags (sglang_launcher.py, sglang_flags.py), the driver's view of engine
health (health.py), the reference server that speaks the same protocol on CPU (reference_server/), the decoders
of what engines return (routed_experts.py, indexer_topk.py), and ScriptedEngine for tests and benchmarks.
"""
