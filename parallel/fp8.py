"""FP8 through Transformer Engine: recipe name -> Megatron TransformerConfig fields.

Recipes (model.fp8): ``delayed`` (amax history, per-tensor scale from past steps), ``tensorwise``
(current scaling: per-tensor scale from this step's amax), ``blockwise`` (128x128 weight / 1x128
activation blocks, Hopper), ``mxfp8`` (32-element microscaling blocks, Blackwell). Format: e4m3 for
the blockwise/mx recipes, hybrid (e4m3 forward, e5m2 gradients) for the per-tensor ones.
FP8 needs CUDA and Transformer Engine; asking for it elsewhere is a one-line error.
"""
from __future__ import annotations

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
_FORMAT = {"delayed": "hybrid", "tensorwise": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}


class FP8Unavailable(RuntimeError):
    """FP8 was asked for where CUDA or Transformer Engine is missing."""


def fp8_config_kwargs(recipe: str, check_device: bool = True) -> dict:
    """TransformerConfig fields for `recipe` ("none" -> no fields)."""
    if recipe in ("none", "", None):
        return {}
    if recipe not in FP8_RECIPES:
        raise ValueError(f"model.fp8 = {recipe!r} is not a recipe; use one of none, {', '.join(FP8_RECIPES)}")
    if check_device:
        require_fp8_runtime(recipe)
    return {"fp8": _FORMAT[recipe], "fp8_recipe": recipe, "fp8_param": False}


def require_fp8_runtime(recipe: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise FP8Unavailable(f"model.fp8 = {recipe!r} needs a CUDA GPU with Transformer Engine; "
                             f"this machine has no CUDA: set model.fp8 = 'none'")
    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        raise FP8Unavailable(f"model.fp8 = {recipe!r} needs Transformer Engine: "
                             f"pip install transformer-engine[pytorch]") from err
