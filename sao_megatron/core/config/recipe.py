"""The root recipe: sections, loading from TOML, dotted overrides, presets, cross-field checks."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .installed import check_installed
from .presets import ADVANTAGES, GROUP_ADVANTAGES, LOSSES, PRESETS
from .recipe_base import read_recipe_file
from .schema import (REMOVED_KEYS, SECTIONS, AlgorithmConfig, CheckpointConfig, CriticConfig, EvalConfig,
                     LaunchConfig, LoggingConfig, ModelConfig, ParallelConfig, RolloutConfig, RunConfig,
                     SFTConfig, WeightSyncConfig)


@dataclass
class Recipe:
    """A whole run. Build it with `load_recipe` so presets and checks are applied."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    source: str = ""  # the recipe file this came from (not a recipe key)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def check(self, check_files: bool = True) -> None:
        """Section checks, then the cross-field checks. Raises ConfigError."""
        for name in SECTIONS:
            getattr(self, name).check(name)
        self._check_algorithm()
        self._check_parallel()
        self._check_lengths()
        self._check_weight_sync()
        if check_files:
            self._check_files()

    def _check_algorithm(self) -> None:
        algo, rollout = self.algorithm, self.rollout
        if algo.loss not in LOSSES and ":" not in algo.loss:
            raise ConfigError("algorithm.loss", f"unknown loss {algo.loss!r}",
                              f"use one of {', '.join(LOSSES)} or an import path 'pkg.mod:fn'")
        if algo.advantage not in ADVANTAGES:
            raise ConfigError("algorithm.advantage", f"unknown estimator {algo.advantage!r}",
                              f"use one of {', '.join(ADVANTAGES)}")
        if algo.advantage in GROUP_ADVANTAGES and (rollout.mode != "group" or rollout.n_samples_per_prompt < 2):
            raise ConfigError("rollout.n_samples_per_prompt",
                              f"group baseline {algo.advantage!r} needs groups of >= 2, got mode="
                              f"{rollout.mode} n={rollout.n_samples_per_prompt}",
                              "set rollout.mode='group' and rollout.n_samples_per_prompt >= 2, or use algorithm.name='sao'")
        if algo.advantage == "gae" and not self.critic.enabled:
            raise ConfigError("critic.enabled", "GAE advantages need a value model",
                              "set critic.enabled = true or pick a group advantage")
        if rollout.mode == "group" and rollout.batch_size % rollout.n_samples_per_prompt:
            raise ConfigError("rollout.batch_size", f"{rollout.batch_size} is not a multiple of the group size "
                              f"{rollout.n_samples_per_prompt}", "make batch_size a multiple of n_samples_per_prompt")
        if algo.mini_batches > rollout.batch_size:
            raise ConfigError("algorithm.mini_batches", f"{algo.mini_batches} > rollout.batch_size "
                              f"{rollout.batch_size}", "use at most batch_size mini-batches")
        policy_steps = self.run.num_steps * algo.mini_batches   # the policy's optimizer steps (parallel/optimizer.py)
        if algo.lr_warmup_steps and algo.lr_warmup_steps >= policy_steps:
            raise ConfigError("algorithm.lr_warmup_steps", f"{algo.lr_warmup_steps} >= the run's {policy_steps} policy "
                              "optimizer steps (run.num_steps x algorithm.mini_batches)",
                              "use fewer warm-up steps than the run has updates")

    def _check_parallel(self) -> None:
        from ..dims import ParallelDims  # imported here: dims.py imports this package's ConfigError

        par = self.parallel
        world = par.resolved_world_size()
        dims = ParallelDims.from_config(par, world)
        dims.validate(world)  # the layout rules: core/dims.py
        per_mini_batch = self.rollout.batch_size // self.algorithm.mini_batches
        if per_mini_batch < dims.dp:   # every data-parallel rank trains on >= 1 sample of each mini-batch
            raise ConfigError("algorithm.mini_batches", f"{self.algorithm.mini_batches} mini-batches of "
                              f"rollout.batch_size {self.rollout.batch_size} leave {per_mini_batch} samples each for "
                              f"{dims.dp} data-parallel ranks", f"use at most {max(1, self.rollout.batch_size // dims.dp)} "
                              "mini-batches or raise rollout.batch_size")
        if par.cp > 1 and self.model.transformer_impl == "local":
            raise ConfigError("parallel.cp", f"{par.cp} needs Transformer Engine attention (Megatron-Core's local "
                              "attention asserts cp == 1)", "set model.transformer_impl = 'auto' or "
                              "'transformer_engine' on a CUDA node with TE, or parallel.cp = 1")
        if self.model.fp8 != "none" and self.model.transformer_impl == "local":
            raise ConfigError("model.fp8", "FP8 needs Transformer Engine layers",
                              "set model.transformer_impl = 'auto' or 'transformer_engine', or model.fp8 = 'none'")

    def _check_reference_model(self, model_dir: Path) -> None:
        """The KL reference loads into a copy of the policy's model: same config.json shape."""
        ref = Path(self.algorithm.ref_model_path)
        fix = "point it at an HF model directory of the policy's architecture, or clear it to use the initial policy"
        if not (ref / "config.json").is_file():
            raise ConfigError("algorithm.ref_model_path", f"{ref} has no config.json", fix)
        if not (model_dir / "config.json").is_file():
            return
        mine, theirs = (json.loads((d / "config.json").read_text()) for d in (model_dir, ref))
        differ = [k for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts",
                              "n_routed_experts", "num_attention_heads") if mine.get(k) != theirs.get(k)]
        if differ:
            raise ConfigError("algorithm.ref_model_path", f"{ref} differs from model.path in {', '.join(differ)}", fix)

    def _check_files(self) -> None:
        from .path_rules import check_path_fields

        check_path_fields(self)   # a NUL byte or an over-long name: one line, not an OSError from a stat
        model_dir = Path(self.model.path)
        if not (model_dir / "config.json").is_file() and not (self.model.init_preset or self.model.shape_preset):
            raise ConfigError("model.path", f"{model_dir} has no config.json",
                              f"run `sao init-model --arch {self.model.arch} --preset tiny {model_dir}` "
                              "or set model.init_preset = 'tiny'")
        if (model_dir / "config.json").is_file():
            check_model_fits_layout(self, json.loads((model_dir / "config.json").read_text()))
        if self.rollout.dataset and not Path(self.rollout.dataset).exists():
            raise ConfigError("rollout.dataset", f"{self.rollout.dataset} does not exist",
                              "point it at a jsonl/parquet file or an HF datasets folder, or clear it to use rollout.task")
        from .dataset_probe import probe_recipe_datasets

        probe_recipe_datasets(self)   # empty, binary, a folder with no data: one line now, not after the engines start
        if self.algorithm.kl_coef > 0 and self.algorithm.ref_model_path:
            self._check_reference_model(model_dir)
        _check_writable(Path(self.run.output_dir))
        check_installed(self)

    def _check_weight_sync(self) -> None:
        if self.weight_sync.method == "shard_writes" and self.rollout.engine != "reference":
            raise ConfigError("weight_sync.method", "'shard_writes' needs engines that take per-rank writes; SGLang "
                              "0.5.23 takes them only through its Mooncake transfer engine, which sao does not "
                              "drive yet (docs/weights.md)", "use 'broadcast' with rollout.engine = 'sglang'")

    def _check_lengths(self) -> None:
        """One whole sequence (longest prompt + response) must fit the model and one micro-batch; under
        context parallelism a micro-batch holds each rank's 1/cp share of the sequence (docs/cluster.md)."""
        rollout, model, par = self.rollout, self.model, self.parallel
        longest = rollout.max_prompt_len + rollout.max_new_tokens
        if model.max_seq_len < longest:
            raise ConfigError("model.max_seq_len", f"{model.max_seq_len} is shorter than rollout.max_prompt_len + "
                              f"rollout.max_new_tokens = {longest}", f"raise it to {longest} or shorten those two")
        share = -(-longest // par.cp)
        if par.micro_batch_tokens < share:
            raise ConfigError("parallel.micro_batch_tokens", f"{par.micro_batch_tokens} is below one sequence "
                              f"({longest} tokens / cp {par.cp} = {share})", f"use at least {share}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    def resolved(self) -> dict:
        """Every value, presets applied, unset ones left out: what resolved_recipe.toml holds."""
        return _drop_none(self.to_dict())

    def dump(self, run_dir: Path) -> Path:
        """Write the resolved recipe (every value, presets applied) into the run directory."""
        run_dir.mkdir(parents=True, exist_ok=True)
        import tomli_w  # small, pure python; only needed to write

        target = run_dir / "resolved_recipe.toml"
        target.write_text(tomli_w.dumps(self.resolved()))
        return target


def check_model_fits_layout(recipe: Recipe, hf: dict) -> None:
    """The layout against the model's HF config.json (heads, experts, layers: core/dims.py), and the length.
    The weight-sync sender's memory against it is checked above this layer, where a run starts
    (rollout/weights/memory.py check_sender_memory: `sao train`, `sao launch`)."""
    from ..dims import ParallelDims
    from ..shape import shape_from_hf

    world = recipe.parallel.resolved_world_size()
    ParallelDims.from_config(recipe.parallel, world).validate(world, shape_from_hf(hf))
    if recipe.model.max_seq_len > hf.get("max_position_embeddings", 1 << 30):
        raise ConfigError("model.max_seq_len", f"{recipe.model.max_seq_len} exceeds the model's "
                          f"max_position_embeddings {hf['max_position_embeddings']}", "lower model.max_seq_len")


def _check_writable(directory: Path) -> None:
    probe = directory
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError("run.output_dir", f"{directory} is not writable (stopped at {probe})",
                          "point run.output_dir at a directory you can write")


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


# ---------------------------------------------------------------------------------------------- loading


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = (), check_files: bool = True) -> Recipe:
    """Read a TOML recipe, apply dotted overrides and the algorithm preset, build and check it."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        raw = read_recipe_file(path)   # its `base` chain merged in (recipe_base.py)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    _apply_preset(raw)
    recipe = build_recipe(raw)
    recipe.source = str(path or "")
    recipe.check(check_files=check_files)
    return recipe


def parse_override(item: str) -> tuple[str, Any]:
    """'a.b=1' or '--a.b=1' -> ('a.b', 1). The value is read as TOML, else kept as a string."""
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(item, "override has no '='", "write overrides as section.key=value")
    key, value = text.split("=", 1)
    try:
        doc = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        doc = {"v": value}
    if len(doc) > 1 or ("\n" in value and isinstance(doc["v"], str) and doc["v"] == value):
        # 'k=1\n[run]\nname="x"' parses as v plus more TOML, which used to be dropped without a word
        raise ConfigError(key.strip(), "the override's value runs past its line (a newline, then more text)",
                          "give one value per override; quote a multi-line string as TOML ('''...''')")
    return key.strip(), doc["v"]


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(key, "override keys have the form section.key", "e.g. algorithm.lr=1e-6")
    raw.setdefault(parts[0], {})
    if not isinstance(raw[parts[0]], dict):
        raise ConfigError(parts[0], "is not a section", f"use one of {', '.join(SECTIONS)}")
    raw[parts[0]][parts[1]] = value


def _apply_preset(raw: dict) -> None:
    name = raw.get("algorithm", {}).get("name", AlgorithmConfig.name)
    if name not in PRESETS:
        raise ConfigError("algorithm.name", f"unknown algorithm {name!r}", f"use one of {', '.join(PRESETS)}")
    for dotted, value in PRESETS[name].items():
        section, key = dotted.split(".")
        raw.setdefault(section, {}).setdefault(key, value)


def build_recipe(raw: dict) -> Recipe:
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(name, "unknown section" + _suggest(name, SECTIONS),
                              f"use one of {', '.join(SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(name, f"is a {type(value).__name__}, not a table", f"write it as [{name}]")
        sections[name] = _build_section(name, SECTIONS[name], value)
    return Recipe(**sections)


def _build_section(section: str, cls, values: dict):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{section}.{key}"
        if key not in known and name in REMOVED_KEYS:
            raise ConfigError(name, "was removed", REMOVED_KEYS[name])
        if key not in known:
            raise ConfigError(name, "unknown key" + _suggest(key, known), f"remove it; valid keys: {', '.join(sorted(known))}")
        kwargs[key] = coerce(name, value, hints[key])
    return cls(**kwargs)


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def coerce(name: str, value: Any, hint) -> Any:
    """Check `value` against a type hint; ints are accepted as floats, nothing else is converted."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(name, value, inner[0])
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(name, f"{value!r} is not allowed" + _suggest(str(value), [str(a) for a in args]),
                              f"use one of {', '.join(repr(a) for a in args)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {type(value).__name__} {value!r}", "write a number like 0.5")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(name, f"{value} is not finite", "write a finite number")
        return float(value)
    expected = {int: "an integer", bool: "true or false", str: "a string", list: "a list", dict: "a table"}
    if hint in expected:
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(name, f"expected {expected[hint]}, got {type(value).__name__} {value!r}",
                              f"write {expected[hint]}")
        return value
    raise TypeError(f"unsupported recipe type {hint} for {name}")
