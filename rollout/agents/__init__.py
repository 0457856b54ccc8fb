"""Agents: multi-turn generation loops (a `rollout.generate_fn`) built on the engine client.
"""
