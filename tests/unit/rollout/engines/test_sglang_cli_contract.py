"""Contract: every flag the launcher renders, rollout.engine_args included, is one SGLang 0.5.23's own parser
takes, with the number of values it takes. The parser's rules are read from the wheel's source (AST, see
sglang_cli.py); rollout/engines/sglang_flags.json, which the recipe check uses, must equal what the wheel says."""
from __future__ import annotations

import pytest
from sglang_cli import wheel_flags

from rollout.engines.sglang_flags import parse_flags, sglang_flags
from rollout.engines.sglang_launcher import SGLangArgs, build_sglang_command


@pytest.fixture(scope="module")
def wheel_table() -> dict:
    return {flag: tuple(v) for flag, v in wheel_flags().items()}


def test_committed_flag_table_is_the_wheels(wheel_table):
    committed = sglang_flags()
    changed = sorted(f for f in set(wheel_table) | set(committed) if wheel_table.get(f) != committed.get(f))
    assert not changed, (f"rollout/engines/sglang_flags.json differs from the wheel for {changed[:10]}: regenerate it with "
                         "`.venv/bin/python tests/support/sglang_cli.py > rollout/engines/sglang_flags.json`")


def test_the_table_reads_the_parser_rules(wheel_table):
    """Spot checks against the source: a store_true field, a BooleanOptionalAction pair, a list field, an
    alias, an explicit add_argument, and a no_cli field with no flag."""
    assert wheel_table["--enable-return-indexer-topk"] == (0, "enable_return_indexer_topk")   # fields/exec_.py
    assert wheel_table["--attn-dp-size"] == (1, "attn_dp_size") == wheel_table["--attention-data-parallel-size"]
    assert wheel_table["--no-enable-tp-lm-head-all-to-all"][0] == 0                  # BooleanOptionalAction
    assert wheel_table["--cuda-graph-bs-decode"][0] == "+" and wheel_table["--lora-paths"][0] == "*"
    assert wheel_table["--config"] == (1, "config") and wheel_table["--enable-dp-attention"][0] == 0
    assert "--speculative-boundary-reduction" not in wheel_table                     # Arg(no_cli=True)


def test_every_rendered_flag_parses_with_its_arity(wheel_table):
    engine_args = ("--chunked-prefill-size", "4096", "--cuda-graph-bs-decode", "1", "2", "4", "--disable-radix-cache")
    args = SGLangArgs(model_path="/m", api_key="k", api_key_config="/o.yaml", tp=8, ep=8, dp_attention=8, fp8=True,
                      seed=3, indexer_topk=True, model_overrides={"indexer_rope_interleave": True}, engine_args=engine_args,
                      extra=("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:29600"))
    cmd = build_sglang_command(args, python="python")
    assert cmd[:5] == ["env", "SGLANG_DSA_FUSE_TOPK=0", "python", "-m", "sglang.launch_server"]
    parsed = parse_flags(cmd[5:], wheel_table)
    assert [f for f, _, _ in parsed][-3:] == ["--chunked-prefill-size", "--cuda-graph-bs-decode", "--disable-radix-cache"]
    assert dict((f, v) for f, _, v in parsed)["--cuda-graph-bs-decode"] == ["1", "2", "4"]
    assert {"--enable-return-indexer-topk", "--attn-dp-size", "--random-seed", "--json-model-override-args"} <= \
        {f for f, _, _ in parsed}


def test_the_unfused_top_k_switch_exists_and_defaults_on(wheel_table):
    """SGLANG_DSA_FUSE_TOPK is a real switch of 0.5.23, on by default: indexer replay must turn it off."""
    from sglang_wheel import load_sources

    assert "SGLANG_DSA_FUSE_TOPK = EnvBool(True)" in load_sources()["sglang/srt/environ.py"]


def test_the_parser_check_refuses_what_argparse_would(wheel_table):
    for argv, needle in ((["--tp-size"], "needs a value"), (["--tp-size", "2", "3"], "'3' is not a flag"),
                         (["--enable-return-indexer-topk", "1"], "'1' is not a flag"), (["--tp"], "no flag --tp")):
        with pytest.raises(ValueError, match=needle):
            parse_flags(argv, wheel_table)

