"""The SGLang command line built from a recipe (the start itself is a GPU test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.engines.sglang_launcher import SGLangArgs, args_from_recipe, build_sglang_command, write_key_config
from sao_megatron.core.config.recipe import load_recipe


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_from_recipe(tmp_path):
    model = tmp_path / "q3"
    model.mkdir()
    (model / "config.json").write_text("{}")
    recipe_file = tmp_path / "r.toml"
    recipe_file.write_text(f'[model]\npath = "{model}"\n[run]\nseed = 11\n'
                           '[rollout]\nengine = "sglang"\nengine_tp = 4\nengine_ep = 4\nengine_dp_attention = 2\n'
                           'engine_fp8 = true\nmem_fraction = 0.6\nhost = "10.0.0.5"\n')
    recipe = load_recipe(recipe_file, [])
    args = args_from_recipe(recipe, index=1, port=31001, api_key="sekret")
    with pytest.raises(ValueError, match="--config file, not the command line"):
        build_sglang_command(args, python="py")
    args.api_key_config = str(write_key_config(tmp_path / "engine1_options.yaml", "sekret"))
    cmd = build_sglang_command(args, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert flag(cmd, "--model-path") == str(model) and flag(cmd, "--host") == "10.0.0.5"
    assert flag(cmd, "--port") == "31001" and flag(cmd, "--config") == args.api_key_config
    assert "sekret" not in " ".join(cmd) and "--api-key" not in cmd   # `ps` shows argv
    assert json.loads(Path(args.api_key_config).read_text()) == {"api-key": "sekret"}
    assert Path(args.api_key_config).stat().st_mode & 0o777 == 0o600
    assert flag(cmd, "--tp-size") == "4" and flag(cmd, "--ep-size") == "4" and flag(cmd, "--attn-dp-size") == "2"
    assert flag(cmd, "--quantization") == "fp8" and flag(cmd, "--mem-fraction-static") == "0.6"
    assert flag(cmd, "--base-gpu-id") == "4"             # engine 1 of tp=4 starts at GPU 4
    assert flag(cmd, "--random-seed") == "12" and flag(cmd, "--weight-version") == "0"   # run.seed + engine index
    assert "--enable-return-routed-experts" in cmd


def test_defaults_leave_optional_flags_out():
    cmd = build_sglang_command(SGLangArgs(model_path="/m"), python="py")
    for absent in ("--attn-dp-size", "--quantization", "--api-key", "--config", "--random-seed"):
        assert absent not in cmd
    assert flag(cmd, "--tp-size") == "1" and "--enable-return-routed-experts" in cmd


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tp=4, ep=3), "engine_ep=3 must divide rollout.engine_tp=4"),
    (dict(tp=4, dp_attention=3), "engine_dp_attention=3"),
    (dict(mem_fraction=1.2), "mem_fraction=1.2"),
    (dict(tp=0), "engine_tp=0"),
])
def test_bad_sizes_name_the_recipe_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        build_sglang_command(SGLangArgs(model_path="/m", **kwargs))
