"""Recipe -> SGLang arguments shared by `sao train` and `sao launch`: rollout.engine_args, DSA models
(indexer top-k with DP attention), engine seeds, and the one-line refusals of bad engine_args."""
from __future__ import annotations

import json

import pytest

from launch.engines import EngineSlot, engine_command
from rollout.engines.sglang_flags import parse_flags
from rollout.engines.sglang_launcher import args_from_recipe, build_sglang_command
from sao_megatron.core.config import ConfigError
from sao_megatron.core.config.recipe import load_recipe


def _recipe(tmp_path, rollout: str = "", hf: dict | None = None):
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(hf or {}))
    path = tmp_path / "r.toml"
    path.write_text(f'[model]\npath = "{model}"\n[run]\nseed = 7\n[rollout]\nengine = "sglang"\n{rollout}\n')
    return load_recipe(path, [], check_files=False)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_engine_args_reach_both_commands_and_seeds_agree(tmp_path):
    recipe = _recipe(tmp_path, 'engine_tp = 2\nengine_args = ["--chunked-prefill-size", "4096", "--disable-radix-cache"]')
    local = build_sglang_command(args_from_recipe(recipe, index=1, port=31000, api_key=""),
                                 python=recipe.launch.python)
    slurm = engine_command(recipe, EngineSlot(engine=1, node=0, head_node=0, node_rank=0, nnodes=1, base_gpu=2,
                                              port=31000))
    for cmd in (local, slurm):
        assert cmd[-3:] == ["--chunked-prefill-size", "4096", "--disable-radix-cache"]
        assert _flag(cmd, "--random-seed") == "8" and _flag(cmd, "--base-gpu-id") == "2"   # run.seed + engine 1
    assert "--enable-return-indexer-topk" not in local and "--attn-dp-size" not in local   # no indexer
    # one mapping (sglang_args): the argv differ only where each runs (the host) and how the key travels
    assert _flag(slurm, "--host") == "$ENGINE_HOST" and "--config" in slurm and "--config" not in local
    assert _without(slurm, "--host", "--config") == _without(local, "--host")


def _without(cmd: list[str], *flags: str) -> list[str]:
    """argv with each of `flags` and its value taken out."""
    drop = {i + k for i, arg in enumerate(cmd) if arg in flags for k in (0, 1)}
    return [arg for i, arg in enumerate(cmd) if i not in drop]


@pytest.mark.parametrize("hf", [{"model_type": "glm_moe_dsa"}, {"model_type": "deepseek_v3", "index_topk": 2048}])
def test_indexer_models_return_topk_with_dp_attention_over_the_engine(tmp_path, hf):
    recipe = _recipe(tmp_path, "engine_tp = 8\nengine_ep = 8", hf)
    cmd = build_sglang_command(args_from_recipe(recipe, 0, 30000, ""), python="py")
    assert "--enable-return-indexer-topk" in cmd and _flag(cmd, "--attn-dp-size") == "8"
    # logical key positions need SGLang's unfused top-k (docs/engines.md, "DSA indexer top-k")
    assert cmd[:3] == ["env", "SGLANG_DSA_FUSE_TOPK=0", "py"]
    parse_flags(cmd[5:])   # every rendered flag is one SGLang 0.5.23 knows, with its arity


def test_dense_deepseek_v3_has_no_indexer_flag(tmp_path):
    recipe = _recipe(tmp_path, "engine_tp = 8", {"model_type": "deepseek_v3"})
    assert "--enable-return-indexer-topk" not in build_sglang_command(args_from_recipe(recipe, 0, 30000, ""))


def test_indexer_model_with_attention_tp_names_the_field(tmp_path):
    recipe = _recipe(tmp_path, "engine_tp = 8\nengine_dp_attention = 2", {"model_type": "glm_moe_dsa"})
    with pytest.raises(ValueError, match=r"rollout.engine_dp_attention=2: .* set it to rollout.engine_tp=8"):
        build_sglang_command(args_from_recipe(recipe, 0, 30000, ""))
    slot = EngineSlot(0, 0, 0, 0, 1, 0, 30000)
    with pytest.raises(ConfigError, match="rollout.engine_dp_attention=2"):
        engine_command(recipe, slot)


@pytest.mark.parametrize("value, needle", [
    ('"--disable-radix-cache"', "expected a list"),   # the loader's type check
    ("[1, 2]", "is not a list of strings"),
    ('["--no-such-flag"]', "SGLang 0.5.23 has no flag --no-such-flag"),
    ('["--chunked-prefill-size"]', "--chunked-prefill-size needs a value"),
    ('["--disable-radix-cache", "yes"]', "'yes' is not a flag"),
    ('["--disable-radix-cache=1"]', "is a switch and takes no value"),
    ('["--tp-size", "4"]', "--tp-size is set by the launcher from rollout.engine_tp"),
    ('["--tensor-parallel-size", "4"]', "set by the launcher from rollout.engine_tp"),   # an alias, same field
    ('["--speculative-algorithm", "NEXTN"]', "speculative decoding is off for RL engines"),
    ('["--speculative-num-steps", "3"]', "speculative decoding is off"),
])
def test_bad_engine_args_are_one_line_recipe_errors(tmp_path, value, needle):
    with pytest.raises(ConfigError, match="rollout.engine_args") as err:
        _recipe(tmp_path, f"engine_args = {value}")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_engine_args_need_sglang(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[model]\npath = "m"\n[rollout]\nengine = "reference"\nengine_args = ["--disable-radix-cache"]\n')
    with pytest.raises(ConfigError, match="rollout.engine_args: SGLang flags with rollout.engine = 'reference'"):
        load_recipe(path, [], check_files=False)


@pytest.mark.parametrize("gpu", ["b200", "gb300"])
def test_fp8_engines_on_blackwell_are_refused_naming_the_gpu(tmp_path, gpu):
    with pytest.raises(ConfigError, match=f"rollout.engine_fp8: FP8 engines on {gpu}: .* UE8M0"):
        _recipe(tmp_path, f'engine_fp8 = true\nengine_gpu = "{gpu}"')
    _recipe(tmp_path, 'engine_fp8 = true\nengine_gpu = "h200"')      # Hopper keeps fp32 block scales
    _recipe(tmp_path, f'engine_fp8 = false\nengine_gpu = "{gpu}"')   # bf16 engines take any GPU


@pytest.mark.parametrize("capability, refused", [((10, 0), True), ((10, 3), True), ((12, 0), True), ((12, 1), True),
                                                 ((9, 0), False), ((8, 0), False)])
def test_engine_start_checks_the_gpu_it_runs_on(monkeypatch, capsys, capability, refused):
    """DEEPGEMM_SCALE_UE8M0 = SM100 family or SM120/121 (SGLang layers/deep_gemm_wrapper/configurer.py:58-60)."""
    from rollout.engines import sglang_launcher

    monkeypatch.setattr(sglang_launcher, "_gpu_of", lambda index: (capability, "NVIDIA X"))
    assert sglang_launcher.fp8_gpu_guard() == (2 if refused else 0)
    err = capsys.readouterr().err
    assert ("NVIDIA X (SM" in err and err.count("\n") == 1) if refused else not err


def test_launch_script_guards_fp8_engines(tmp_path):
    from launch.render import load_launch_recipe, rollout_node_script

    recipe = load_launch_recipe("recipes/glm5_750b_a40b.toml")
    script = rollout_node_script(recipe, 0)
    guard = script.index("fp8_gpu_guard())' || exit 2")
    assert guard < script.index("sglang.launch_server")
    recipe.rollout.engine_fp8 = False
    assert "fp8_gpu_guard" not in rollout_node_script(recipe, 0)


def test_cpu_rollout_nodes_serve_dsa_models_with_indexer_topk(tmp_path):
    """`sao launch` on CPU runs the reference server; it answers return_indexer_topk only with the flag, as SGLang."""
    import argparse

    from rollout.engines.reference_server.server import add_arguments   # `sao serve`'s parser takes the flag
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    slot = EngineSlot(0, 0, 0, 0, 1, 0, 30000)
    for hf, flagged in (({"model_type": "glm_moe_dsa"}, True), ({"model_type": "qwen3_moe"}, False)):
        recipe = _recipe(tmp_path, "", hf)
        recipe.rollout.engine = "reference"
        argv = engine_command(recipe, slot)
        assert ("--enable-return-indexer-topk" in argv) == flagged
        assert parser.parse_args(argv[argv.index("serve") + 1:]).enable_return_indexer_topk == flagged


def test_reference_engines_get_the_same_flags_from_sao_train_and_sao_launch(tmp_path, monkeypatch):
    """The CPU stand-in too: `sao launch`'s node argv and `sao train`'s local server take one mapping
    (reference_server_args, engine_seed): seed run.seed + engine, weight-update ranks, dtype, shard writes."""
    import argparse

    import rollout.engines.reference_server as reference_server
    from rollout.engines.reference_server.server import add_arguments
    from sao_megatron.trainer.engines import launch_engine

    recipe = _recipe(tmp_path, "engine_tp = 2", {"model_type": "glm_moe_dsa"})
    recipe.rollout.engine, recipe.rollout.engine_dtype, recipe.weight_sync.method = "reference", "bf16", "shard_writes"
    started = {}
    monkeypatch.setattr(reference_server, "launch_local", lambda model, **kw: started.update(kw))
    launch_engine(recipe, index=1, api_key="", run_dir=tmp_path)
    slurm = engine_command(recipe, EngineSlot(1, 1, 1, 0, 1, 0, 30000))

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    local = vars(parser.parse_args(["--model", "m", "--seed", str(started["seed"]), *started["extra_args"]]))
    launched = vars(parser.parse_args(slurm[slurm.index("serve") + 1:]))
    for key in ("seed", "tp", "dtype", "shard_writes", "quantization", "enable_return_indexer_topk"):
        assert local[key] == launched[key], key
    assert (launched["seed"], launched["tp"], launched["dtype"]) == (8, 2, "bf16")
    assert launched["shard_writes"] and launched["enable_return_indexer_topk"]


def test_a_model_made_at_start_is_recognised_by_its_preset(tmp_path):
    """model.path without config.json yet (init_preset: `sao train` makes it): the family's preset decides."""
    from rollout.engines.sglang_launcher import engine_model_config, has_indexer

    path = tmp_path / "r.toml"
    for arch, indexer in (("glm5", True), ("qwen3_moe", False)):
        path.write_text(f'[model]\npath = "{tmp_path}/later"\narch = "{arch}"\ninit_preset = "tiny"\n')
        assert has_indexer(engine_model_config(load_recipe(path, [], check_files=False))) == indexer


def _overrides(cmd: list[str]) -> dict | None:
    return json.loads(_flag(cmd, "--json-model-override-args")) if "--json-model-override-args" in cmd else None


@pytest.mark.parametrize("hf, expected", [
    ({"model_type": "glm_moe_dsa"}, {"indexer_rope_interleave": True}),             # transformers' GLM-5 rule
    ({"model_type": "glm_moe_dsa", "indexer_rope_interleave": True}, None),         # the checkpoint says it
    ({"model_type": "glm_moe_dsa", "indexer_rope_interleave": False}, None),        # explicit: kept
    ({"model_type": "deepseek_v32", "index_topk": 2048}, None),                     # V3.2 rotates half-split
])
def test_glm5_engines_rotate_the_indexer_as_transformers_does(tmp_path, hf, expected):
    recipe = _recipe(tmp_path, "engine_tp = 2", hf)
    assert _overrides(build_sglang_command(args_from_recipe(recipe, 0, 30000, ""))) == expected


def test_engine_args_overrides_merge_into_one_flag(tmp_path):
    recipe = _recipe(tmp_path, """engine_args = ["--json-model-override-args", '{"indexer_rope_interleave": false, "x": 1}']""",
                     {"model_type": "glm_moe_dsa"})
    cmd = build_sglang_command(args_from_recipe(recipe, 0, 30000, ""))
    assert cmd.count("--json-model-override-args") == 1
    assert _overrides(cmd) == {"indexer_rope_interleave": False, "x": 1}   # the recipe's own value wins
    with pytest.raises(ConfigError, match="rollout.engine_args: --json-model-override-args 'nope' is not a JSON object"):
        _recipe(tmp_path, 'engine_args = ["--json-model-override-args", "nope"]')


def test_sao_train_refuses_to_start_fp8_engines_on_blackwell(tmp_path, monkeypatch):
    """launch_sglang checks the engine's GPU before it starts anything (no process is spawned)."""
    import importlib.util
    import subprocess

    from rollout.engines import sglang_launcher

    recipe = _recipe(tmp_path, "engine_fp8 = true")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())   # "SGLang is installed"
    monkeypatch.setattr(sglang_launcher, "_gpu_of", lambda index: ((10, 0), "NVIDIA B200"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(RuntimeError, match=r"rollout.engine_fp8: this engine's GPU is NVIDIA B200 \(SM100\)"):
        sglang_launcher.launch_sglang(recipe, 0, 30000, "", tmp_path / "e.log", timeout_s=1)
