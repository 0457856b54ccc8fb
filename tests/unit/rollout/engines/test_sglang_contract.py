"""Contract test: every route, request field and reply field SGLangEngine uses exists in SGLang.

Downloads the pinned wheel without dependencies (`pip download sglang==0.5.23 --no-deps`, ~39 MB,
cached under build/sglang_wheel/) and reads its sources as text/AST; SGLang is never imported. If
the registry cannot be reached the test FAILS with that reason: the contract is not optional.
"""
from __future__ import annotations

import ast
import asyncio

import pytest
from sglang_wheel import load_sources

from rollout.engines.engine import GenerateRequest
from rollout.engines.sglang_client import (META_INFO_FIELDS, ROUTES, SAMPLING_FIELDS, SGLANG_VERSION, SGLangEngine,
                                   generate_body)
from rollout.engines.sglang_launcher import SGLangArgs, build_sglang_command


@pytest.fixture(scope="module")
def sglang_sources() -> dict[str, str]:
    return load_sources()


def routes_of(source: str) -> dict[str, set[str]]:
    """Paths -> HTTP methods from @app.get/@app.post/@app.api_route decorators."""
    routes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
                continue
            if not deco.args or not isinstance(deco.args[0], ast.Constant):
                continue
            kind, path = deco.func.attr, deco.args[0].value
            if kind in ("get", "post", "put"):
                methods = {kind.upper()}
            else:
                methods = {m.value for kw in deco.keywords if kw.arg == "methods" for m in kw.value.elts}
            routes.setdefault(path, set()).update(methods)
    return routes


def class_fields(source: str) -> dict[str, set[str]]:
    """Class name -> annotated field names, including those of base classes in the same file."""
    tree = ast.parse(source)
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def collect(name, seen=()):
        fields = set(own.get(name, ()))
        for base in bases.get(name, ()):
            if base not in seen:
                fields |= collect(base, seen + (name,))
        return fields
    return {name: collect(name) for name in own}


def test_every_route_the_client_uses_exists(sglang_sources):
    routes = routes_of(sglang_sources["sglang/srt/entrypoints/http_server.py"])
    for path, (method, _, _) in ROUTES.items():
        assert path in routes, f"SGLang {SGLANG_VERSION} has no route {path}"
        assert method in routes[path], f"SGLang {path} accepts {sorted(routes[path])}, not {method}"


def test_every_request_field_the_client_sends_exists(sglang_sources):
    structs = class_fields(sglang_sources["sglang/srt/managers/io_struct.py"])
    for path, (_, struct, fields) in ROUTES.items():
        if struct is None:
            continue
        assert struct in structs, f"io_struct.py has no {struct} (route {path})"
        missing = set(fields) - structs[struct]
        assert not missing, f"{struct} ({path}) lacks fields {sorted(missing)}"
    sampling = class_fields(sglang_sources["sglang/srt/sampling/sampling_params.py"])["SamplingParams"]
    assert not set(SAMPLING_FIELDS) - sampling, sorted(set(SAMPLING_FIELDS) - sampling)


def test_every_reply_field_the_client_reads_is_written(sglang_sources):
    writers = sglang_sources["sglang/srt/managers/tokenizer_manager.py"] + \
        sglang_sources["sglang/srt/utils/weight_versions.py"]
    for key in META_INFO_FIELDS:
        assert f'"{key}"' in writers, f"SGLang never writes meta_info[{key!r}]"
    model_info = sglang_sources["sglang/srt/entrypoints/http_server.py"]
    assert '"weight_version": _global_state.tokenizer_manager' in model_info


def test_launcher_flags_are_sglang_server_args(sglang_sources):
    fields = set()
    for name, text in sglang_sources.items():
        if name.startswith("sglang/srt/arg_groups/fields/") or name == "sglang/srt/server_args.py":
            for values in class_fields(text).values():
                fields |= values
    cmd = build_sglang_command(SGLangArgs(model_path="/m", api_key="k", api_key_config="/o.yaml", tp=4, ep=2,
                                          dp_attention=2, fp8=True, seed=1), python="python")
    flags = [a for a in cmd[3:] if a.startswith("--")]
    # --config is a parser option, not a field: SGLang reads the api key (a field) from that YAML file
    assert '"--config"' in sglang_sources["sglang/srt/server_args.py"] and "api_key" in fields
    unknown = [f for f in flags if f != "--config" and f[2:].replace("-", "_") not in fields]
    assert not unknown, f"SGLang {SGLANG_VERSION} server args have no fields for {unknown}"


def test_client_sends_only_what_the_table_declares(monkeypatch):
    """Drive every Engine method with a recording transport: paths, methods and body keys stay in ROUTES."""
    sent = []
    replies = {"/model_info": {"weight_version": "3", "moe_topk": 2},
               "/generate": {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"},
                                                             "weight_version": "3", "output_token_logprobs": []}},
               "/get_weights_by_name": [[0.0]]}

    async def fake_call(self, method, path, body, timeout_s):
        sent.append((method, path, set(body or {}), set((body or {}).get("sampling_params", {}))))
        return 200, replies.get(path, {"success": True, "message": "ok"})

    monkeypatch.setattr(SGLangEngine, "_call", fake_call)

    async def drive():
        e = SGLangEngine("http://x", name="fake")
        e.cache_namespace = "sao-w3"
        await e.generate(GenerateRequest(rid="r", input_ids=[1], max_new_tokens=2, seed=1))
        await e.begin_weight_update(), await e.end_weight_update()
        await e.abort("r"), await e.abort(), await e.pause("retract"), await e.resume(), await e.flush_cache()
        await e.health(), await e.weight_version(), await e.get_weights_by_name("w")
        await e.check_weights(skip_tensor_list=["x"])
        await e.init_weights_update_group("h", 1, 1, 2, "g", "nccl")
        await e.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], "g", 4)
        await e.update_weights_from_disk("/m", 5), await e.destroy_weights_update_group("g")
    asyncio.run(drive())
    assert {p for _, p, _, _ in sent} == set(ROUTES)
    for method, path, keys, sampling in sent:
        declared_method, _, fields = ROUTES[path]
        assert method == declared_method and keys <= set(fields), (path, keys - set(fields))
        assert sampling <= set(SAMPLING_FIELDS)
    assert set(generate_body(GenerateRequest(rid="r", input_ids=[1], max_new_tokens=1, seed=2))["sampling_params"]) \
        == set(SAMPLING_FIELDS)
