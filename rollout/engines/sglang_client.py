"""`SGLangEngine`: both roles of a rollout server (`Generator`, `WeightReceiver`) over SGLang's HTTP
protocol (SGLang 0.5.23 or `sao serve`).

One pooled aiohttp session per engine; every call has a timeout; connection failures (refused,
reset, server disconnected) are retried with exponential backoff ``backoff_s * 2**attempt``, nothing
else is (an HTTP error or a timeout is the engine's answer). Every reply is checked and a malformed
one raises `EngineError` naming the engine, the route and the field.

Weight versions are strings in SGLang; ours are ints. The client sends ``str(version)`` and reads
``int(...)`` back; SGLang's initial ``"default"`` reads as 0 (the weights it was started with).
Per-token versions come from ``meta_info.output_token_weight_versions`` (reference server) or are
expanded from SGLang's ``meta_info.weight_versions`` spans.

Routes: SGLang returns ``[tokens, num_hidden_layers, num_experts_per_tok]`` but never reports that
shape (/model_info has no such keys), so the client takes it from the model's config.json when the
engines are built (`rollout.engines.routed_experts.route_shape_from_config`).

DSA indexer top-k (rollout/engines/indexer_topk.py): a client told ``index_topk`` (the model has an indexer,
`indexer_shape_from_config`) sends ``return_indexer_topk`` with every request that wants it
(GenerateRequest.return_indexer_topk, true by default). A reply without it (an engine started
without --enable-return-indexer-topk) or with values that cannot be logical key positions (SGLang's
fused top-k returns KV slots) gives ``indexer_topk=None`` and one warning per engine: the trainer
then selects keys itself. A reply of the wrong shape is an EngineError naming the engine, the field
and both shapes.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Optional

from rollout.engines.engine import EngineError, GenerateRequest, GenerateResult, Generator
from rollout.engines.indexer_topk import decode_indexer_topk, logical_violation
from rollout.engines.routed_experts import decode_routed_experts
from rollout.weights.receiver import WeightReceiver

import torch

log = logging.getLogger(__name__)
FINISH_TYPES = ("stop", "length", "abort")

# Everything this client uses of SGLang's protocol. tests/unit/rollout/engines/test_sglang_contract.py checks each
# entry against the pinned SGLang's http_server.py (routes), io_struct.py (request structs),
# sampling_params.py and the meta_info keys its tokenizer manager writes, and checks that the client
# sends nothing beyond this table.
SGLANG_VERSION = "0.5.23"
ROUTES: dict[str, tuple[str, str | None, tuple[str, ...]]] = {   # path: (method, request struct, fields sent)
    "/generate": ("POST", "GenerateReqInput", ("rid", "input_ids", "sampling_params", "return_logprob",
                                               "logprob_start_len", "return_routed_experts", "return_indexer_topk",
                                               "extra_key")),
    "/abort_request": ("POST", "AbortReq", ("rid", "abort_all")),
    "/pause_generation": ("POST", "PauseGenerationReqInput", ("mode",)),
    "/continue_generation": ("POST", "ContinueGenerationReqInput", ()),
    "/flush_cache": ("POST", None, ()),
    "/health": ("GET", None, ()),
    "/model_info": ("GET", None, ()),
    "/init_weights_update_group": ("POST", "InitWeightsUpdateGroupReqInput", (
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")),
    "/destroy_weights_update_group": ("POST", "DestroyWeightsUpdateGroupReqInput", ("group_name",)),
    "/begin_weight_update": ("POST", "BeginWeightUpdateReqInput", ("selector",)),
    "/end_weight_update": ("POST", "EndWeightUpdateReqInput", ()),
    "/update_weights_from_distributed": ("POST", "UpdateWeightsFromDistributedReqInput", (
        "names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format")),
    "/update_weights_from_disk": ("POST", "UpdateWeightFromDiskReqInput", ("model_path", "weight_version",
                                                                          "flush_cache")),
    "/get_weights_by_name": ("POST", "GetWeightsByNameReqInput", ("name", "truncate_size")),
    "/weights_checker": ("POST", "CheckWeightsReqInput", ("action", "skip_tensor_list", "selector")),
}
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed")
META_INFO_FIELDS = ("finish_reason", "prompt_tokens", "weight_version", "weight_versions",
                    "output_token_logprobs", "routed_experts", "indexer_topk")


def _aiohttp():
    try:
        import aiohttp
    except ImportError as err:   # a core dependency, but say how to fix it
        raise ImportError("SGLangEngine needs aiohttp: pip install 'aiohttp>=3.9'") from err
    return aiohttp


class SGLangEngine(Generator, WeightReceiver):
    """HTTP client of one SGLang-protocol server at `url` (e.g. "http://127.0.0.1:30000").

    ``moe_topk`` and ``num_layers`` give the routes' shape (experts per token, hidden layers); build
    them with ``**route_shape_from_config(model_path)``. Without ``moe_topk`` a request for routes fails.
    ``index_topk`` and ``num_indexer_layers`` (``**indexer_shape_from_config(model_path)``) give the
    DSA indexer's; without ``index_topk`` the client never asks for indexer top-k.
    """

    def __init__(self, url: str, api_key: str = "", name: Optional[str] = None, timeout_s: float = 600.0,
                 control_timeout_s: float = 60.0, weight_timeout_s: float = 600.0, max_retries: int = 3,
                 backoff_s: float = 0.5, moe_topk: Optional[int] = None, num_layers: Optional[int] = None,
                 max_connections: int = 256, index_topk: Optional[int] = None,
                 num_indexer_layers: Optional[int] = None):
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.api_key = api_key
        self.timeout_s = timeout_s                  # /generate
        self.control_timeout_s = control_timeout_s  # abort, pause, health, info, reads
        self.weight_timeout_s = weight_timeout_s    # group init, weight updates (wait on the trainer)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.moe_topk = moe_topk
        self.num_layers = num_layers
        self.max_connections = max_connections
        self.index_topk = index_topk
        self.num_indexer_layers = num_indexer_layers or num_layers
        self._indexer_warned = False
        self._session = None

    # ---- transport ----
    def _fail(self, what: str) -> EngineError:
        return EngineError(f"engine {self.name}: {what}")

    async def _get_session(self):
        aiohttp = _aiohttp()
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def _call(self, method: str, path: str, body: Optional[dict], timeout_s: float) -> tuple[int, Any]:
        """One HTTP call with retries on connection errors; returns (status, parsed JSON or text)."""
        aiohttp = _aiohttp()
        session = await self._get_session()
        for attempt in range(self.max_retries + 1):
            try:
                async with session.request(method, self.url + path, json=body,
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                    text = await reply.text()
                    return reply.status, _maybe_json(reply.content_type, text)
            except asyncio.TimeoutError:
                raise self._fail(f"{path} timed out after {timeout_s:.0f}s") from None
            except aiohttp.ClientConnectionError as err:
                if attempt == self.max_retries:
                    raise self._fail(f"{path} failed after {attempt + 1} connection attempts: "
                                     f"{type(err).__name__}: {err}") from err
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _ok(self, method: str, path: str, body: Optional[dict], timeout_s: float) -> Any:
        status, data = await self._call(method, path, body, timeout_s)
        if not 200 <= status < 300:
            raise self._fail(f"{path} answered HTTP {status}: {_message(data)}")
        return data

    async def _success(self, path: str, body: dict, timeout_s: float) -> dict:
        """Routes answering {success, message}: raise with the engine's message unless success."""
        status, data = await self._call("POST", path, body, timeout_s)
        if not isinstance(data, dict) or "success" not in data:
            raise self._fail(f"{path} answered HTTP {status} without a 'success' field: {str(data)[:300]}")
        if not data["success"] or not 200 <= status < 300:
            raise self._fail(f"{path} failed: {data.get('message', '')}")
        return data

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # ---- generation ----
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ask_indexer = bool(request.return_indexer_topk and self.index_topk)
        body = generate_body(request, self.cache_namespace, ask_indexer)
        data = await self._ok("POST", "/generate", body, self.timeout_s)
        meta = data.get("meta_info") if isinstance(data, dict) else None
        if request.return_routed_experts and isinstance(meta, dict) and "routed_experts" in meta \
                and self.moe_topk is None:
            raise self._fail("cannot decode routed experts: moe_topk unknown (SGLang does not report it); "
                             "build the client with **route_shape_from_config(model_path)")
        indexer_shape = (self.num_indexer_layers, self.index_topk) if ask_indexer else None
        try:
            result = parse_generate_reply(data, request, self.moe_topk, self.num_layers, self.name, indexer_shape)
        except ValueError as err:
            raise self._fail(f"/generate reply for rid {request.rid}: {err}") from None
        if ask_indexer:
            result.indexer_topk = self._replayable(result, data["meta_info"])
        return result

    def _replayable(self, result: GenerateResult, meta: dict) -> Optional[torch.Tensor]:
        """The reply's indexer top-k if the trainer can replay it, else None (said once per engine)."""
        topk = result.indexer_topk
        if topk is None:
            if result.finish_reason != "abort" or result.output_ids:
                self._warn_indexer("its replies carry no meta_info.indexer_topk (start it with "
                                   "--enable-return-indexer-topk)")
            return None
        problem = logical_violation(topk)
        if problem:
            self._warn_indexer(f"its meta_info.indexer_topk are not logical key positions ({problem}); SGLang's "
                               "fused DSA top-k returns KV-cache slots: run it with SGLANG_DSA_FUSE_TOPK=0")
            return None
        return topk

    def _warn_indexer(self, why: str) -> None:
        if not self._indexer_warned:
            self._indexer_warned = True
            log.warning("engine %s: %s; its samples carry no DSA indexer choices and the trainer selects keys "
                        "itself", self.name, why)

    async def abort(self, rid: Optional[str] = None) -> None:
        await self._ok("POST", "/abort_request", {"rid": rid or "", "abort_all": rid is None}, self.control_timeout_s)

    async def pause(self, mode: str = "in_place") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r} unknown; use abort, retract or in_place")
        await self._ok("POST", "/pause_generation", {"mode": mode}, self.control_timeout_s)

    async def resume(self) -> None:
        await self._ok("POST", "/continue_generation", {}, self.control_timeout_s)

    async def flush_cache(self) -> None:
        await self._ok("POST", "/flush_cache", None, self.control_timeout_s)

    async def health(self) -> bool:
        """True iff /health answers 200 within the control timeout (never raises on a dead server)."""
        try:
            status, _ = await self._call("GET", "/health", None, self.control_timeout_s)
        except EngineError:
            return False
        return status == 200

    async def model_info(self) -> dict:
        info = await self._ok("GET", "/model_info", None, self.control_timeout_s)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise self._fail(f"/model_info reply has no 'weight_version': {str(info)[:300]}")
        return info

    async def load(self) -> dict:
        """The engine's own load numbers from SGLang's /v1/loads (entrypoints/v1_loads.py:96; fields of
        managers/load_snapshot.py:196 LoadSnapshot), over its DP ranks: running and waiting requests summed,
        KV usage (token_usage) of the fullest rank, generation throughput (tokens/s) summed."""
        data = await self._ok("GET", "/v1/loads?include=core", None, self.control_timeout_s)
        loads = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(loads, list) or not loads:
            raise self._fail(f"/v1/loads reply has no 'loads': {str(data)[:300]}")
        return {"running_requests": sum(float(r.get("num_running_reqs", 0)) for r in loads),
                "queued_requests": sum(float(r.get("num_waiting_reqs", 0)) for r in loads),
                "kv_usage": max(float(r.get("token_usage", 0.0)) for r in loads),
                "gen_throughput": sum(float(r.get("gen_throughput", 0.0)) for r in loads)}

    async def weight_version(self) -> int:
        try:
            return parse_version((await self.model_info())["weight_version"])
        except ValueError as err:
            raise self._fail(f"/model_info: {err}") from None

    # ---- weights ----
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Returns once the engine has joined; the trainer (rank 0) must be joining concurrently."""
        await self._success("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, self.weight_timeout_s)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._success("/destroy_weights_update_group", {"group_name": group_name}, self.weight_timeout_s)

    async def begin_weight_update(self) -> None:
        """Open the weight-update session for every runner ("all": target and draft models)."""
        await self._success("/begin_weight_update", {"selector": "all"}, self.weight_timeout_s)

    async def end_weight_update(self) -> None:
        await self._success("/end_weight_update", {}, self.weight_timeout_s)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: int, flattened_bucket: bool = True,
                                              flush_cache: bool = True) -> None:
        """Returns after the engine received and loaded the bucket; the trainer broadcasts concurrently."""
        await self._success("/update_weights_from_distributed", {
            "names": names, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": str(weight_version),
            "load_format": "flattened_bucket" if flattened_bucket else None}, self.weight_timeout_s)

    async def update_weight_version(self, version: int) -> None:
        await self._success("/update_weight_version", {"new_version": str(version), "abort_all_requests": False},
                            self.weight_timeout_s)

    async def join_shard_groups(self, master_address: str, groups: list[dict]) -> None:
        await self._success("/sao_join_shard_groups", {"master_address": master_address, "groups": groups},
                            self.weight_timeout_s)

    async def destroy_shard_groups(self, group_names: list[str]) -> None:
        await self._success("/sao_destroy_shard_groups", {"group_names": group_names}, self.weight_timeout_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: int, flush_cache: bool = True) -> None:
        await self._success("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": str(weight_version), "flush_cache": flush_cache},
            self.weight_timeout_s)

    async def get_weights_by_name(self, name: str) -> torch.Tensor:
        """The whole tensor as float32 (SGLang sends JSON numbers; exact for fp32/bf16/fp16 weights)."""
        data = await self._ok("POST", "/get_weights_by_name", {"name": name, "truncate_size": 2**31 - 1},
                              self.weight_timeout_s)
        if not isinstance(data, (list, float, int)):
            raise self._fail(f"/get_weights_by_name {name!r}: expected a (nested) list of numbers, got "
                             f"{type(data).__name__}")
        try:
            return torch.tensor(data, dtype=torch.float32)
        except (TypeError, ValueError) as err:
            raise self._fail(f"/get_weights_by_name {name!r}: ragged or non-numeric reply ({err})") from None

    async def check_weights(self, action: str = "checksum", skip_tensor_list: Optional[list[str]] = None,
                            selector: str = "all"):
        """/weights_checker: the engine's per-rank tensor checksums (rollout/weights/checksum.py)."""
        from rollout.weights.checksum import parse_weights_checker_reply

        body = {"action": action, "selector": selector}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        data = await self._success("/weights_checker", body, self.weight_timeout_s)
        try:
            return parse_weights_checker_reply(data)
        except ValueError as err:
            raise self._fail(f"/weights_checker reply: {err}") from None


def generate_body(request: GenerateRequest, cache_namespace: Optional[str] = None,
                  return_indexer_topk: bool = False) -> dict:
    """SGLang /generate body for one request (output-token logprobs only: logprob_start_len -1).
    ``cache_namespace`` goes out as ``extra_key``, SGLang's prefix-cache namespace;
    ``return_indexer_topk`` is sent only when true (the engine serves a DSA model)."""
    sampling = {"max_new_tokens": request.max_new_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "top_k": request.top_k, "stop_token_ids": list(request.stop_token_ids)}
    if request.seed is not None:
        sampling["sampling_seed"] = request.seed
    body = {"rid": request.rid, "input_ids": list(request.input_ids), "sampling_params": sampling,
            "return_logprob": request.return_logprob, "logprob_start_len": -1,
            "return_routed_experts": request.return_routed_experts}
    if return_indexer_topk:
        body["return_indexer_topk"] = True
    if cache_namespace is not None:
        body["extra_key"] = cache_namespace
    return body


def parse_version(value: Any) -> int:
    if value == "default":   # SGLang's name for the weights it started with
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {value!r} is not an integer") from None


def parse_generate_reply(data: Any, request: GenerateRequest, top_k: Optional[int],
                         num_layers: Optional[int], engine: str,
                         indexer_shape: Optional[tuple[int, int]] = None) -> GenerateResult:
    """Check and convert one /generate reply; ValueError names the bad field. ``indexer_shape``
    ((num_indexer_layers, index_topk)) when indexer top-k was asked for: decoded if present."""
    if not isinstance(data, dict):
        raise ValueError(f"reply is {type(data).__name__}, expected an object")
    output_ids, meta = data.get("output_ids"), data.get("meta_info")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise ValueError("'output_ids' missing or not a list of ints")
    if not isinstance(meta, dict):
        raise ValueError("'meta_info' missing")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_TYPES:
        raise ValueError(f"meta_info.finish_reason {finish!r} has no type in {FINISH_TYPES}")
    if "weight_version" not in meta:
        raise ValueError("meta_info.weight_version missing")
    n = len(output_ids)
    logprobs = _logprobs(meta, output_ids) if request.return_logprob else []
    routes = None
    if request.return_routed_experts and (n or kind != "abort"):
        if "routed_experts" not in meta:
            if kind != "abort":
                raise ValueError("meta_info.routed_experts missing (was the server started with "
                                 "--enable-return-routed-experts?)")
        else:
            routes = decode_routed_experts(meta["routed_experts"], len(request.input_ids) + n - 1, top_k, num_layers)
    indexer = None
    if indexer_shape is not None and "indexer_topk" in meta:
        indexer = decode_indexer_topk(meta["indexer_topk"], max(len(request.input_ids) + n - 1, 0), *indexer_shape)
    return GenerateResult(rid=request.rid, output_ids=output_ids, output_logprobs=logprobs, finish_reason=kind,
                          weight_version=parse_version(meta["weight_version"]),
                          output_weight_versions=_token_versions(meta, n), routed_experts=routes,
                          indexer_topk=indexer,
                          prompt_tokens=int(meta.get("prompt_tokens", len(request.input_ids))), engine=engine)


def _logprobs(meta: dict, output_ids: list[int]) -> list[float]:
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        got = len(entries) if isinstance(entries, list) else "none"
        raise ValueError(f"meta_info.output_token_logprobs has {got} entries for {len(output_ids)} output tokens")
    out = []
    for i, (entry, token) in enumerate(zip(entries, output_ids)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[1] != token:
            raise ValueError(f"meta_info.output_token_logprobs[{i}] = {entry!r} does not match output token {token}")
        value = entry[0]
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value > 1e-6:
            raise ValueError(f"meta_info.output_token_logprobs[{i}] = {value!r} is not a finite logprob <= 0")
        out.append(float(value))
    return out


def _token_versions(meta: dict, n: int) -> Optional[list[int]]:
    if "output_token_weight_versions" in meta:
        versions = meta["output_token_weight_versions"]
        if not isinstance(versions, list) or len(versions) != n:
            raise ValueError(f"meta_info.output_token_weight_versions must list {n} versions")
        return [parse_version(v) for v in versions]
    spans = meta.get("weight_versions")
    if not spans:
        return None
    versions: list[Optional[int]] = [None] * n
    for span in spans:
        for i in range(max(span["start"], 0), min(span["end"], n)):
            versions[i] = parse_version(span["version"])
    if any(v is None for v in versions):
        raise ValueError(f"meta_info.weight_versions spans {spans!r} do not cover all {n} output tokens")
    return versions


def _maybe_json(content_type: str, text: str) -> Any:
    import json

    if "json" in content_type:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def _message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err or data.get("message") or data)[:500]
    return str(data)[:500]
