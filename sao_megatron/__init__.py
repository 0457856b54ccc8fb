"""sao-megatron: asynchronous single-rollout RL (SAO) for Megatron-Core MoE models."""
__version__ = "0.1.0"
