"""Start and stop real SGLang servers (`python -m sglang.launch_server`) for a recipe's engines.

`build_sglang_command` is pure (unit-tested on the flags it emits;
tests/unit/rollout/engines/test_sglang_cli_contract.py parses every flag it renders with SGLang 0.5.23's own
parser rules, rollout/engines/sglang_flags.py). `launch_sglang` needs CUDA and an SGLang install
(`pip install "sglang==0.5.23"`, the `gpu` extra); its start is exercised by tests/gpu.

Placement: engine ``index`` uses GPUs ``[index * gpus_per_engine, (index + 1) * gpus_per_engine)``
of its node via ``--base-gpu-id`` (gpus_per_engine = tp; dp-attention and EP live inside the TP
group in SGLang).

`sglang_args` is the one place a recipe becomes SGLang arguments, and `reference_server_args` the one place
it becomes the reference server's (`sao serve`, SGLang's CPU stand-in): `sao train` (launch_sglang,
trainer/engines.py) and launch/engines.py (`sao launch`'s rollout nodes) both call them, so both give engine
``i`` the seed `engine_seed` (``run.seed + i``) and the same flags.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sao_megatron.core.ports import free_port


@dataclass
class SGLangArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""              # written to api_key_config by launch_sglang, never put on the argv
    api_key_config: str = ""       # YAML file SGLang reads with --config: the key stays out of `ps`
    tp: int = 1
    ep: int = 1
    dp_attention: int = 0          # 0 = off; else the attention data-parallel size (--attn-dp-size)
    fp8: bool = False
    mem_fraction: float = 0.7
    base_gpu_id: int = 0
    seed: Optional[int] = None
    indexer_topk: bool = False     # DSA model: return each token's indexer top-k (needs attn_tp_size == 1)
    model_overrides: Optional[dict] = None   # config.json attributes to override (--json-model-override-args)
    extra: tuple[str, ...] = ()    # placement flags (multi-node engines)
    engine_args: tuple[str, ...] = ()   # rollout.engine_args, appended last (checked: rollout/engines/sglang_flags.py)


def check_args(a: SGLangArgs) -> None:
    """ValueError naming the recipe field (rollout.*) for sizes SGLang would reject later, slowly."""
    if a.tp < 1 or a.ep < 1:
        raise ValueError(f"rollout.engine_tp={a.tp} / rollout.engine_ep={a.ep} must be >= 1")
    if a.tp % a.ep:
        raise ValueError(f"rollout.engine_ep={a.ep} must divide rollout.engine_tp={a.tp} (SGLang's EP lives "
                         "inside the TP group)")
    if a.dp_attention and a.tp % a.dp_attention:   # SGLang asserts it: arg_groups/parallel_hook.py:326
        raise ValueError(f"rollout.engine_dp_attention={a.dp_attention} must divide rollout.engine_tp={a.tp}")
    if a.indexer_topk and a.tp > 1 and a.dp_attention != a.tp:
        # The capturer asserts attn_tp_size == 1 (state_capturer/indexer_topk.py:32-33), and attn_tp_size =
        # tp_size // attn_dp_size // attn_cp_size (runtime_context.py:73-76).
        raise ValueError(f"rollout.engine_dp_attention={a.dp_attention}: a DSA model's indexer replay needs DP "
                         f"attention across the whole engine (SGLang returns indexer top-k only when attention "
                         f"is not tensor-parallel); set it to rollout.engine_tp={a.tp} (or 0 = that)")
    if not 0 < a.mem_fraction < 1:
        raise ValueError(f"rollout.mem_fraction={a.mem_fraction} must be in (0, 1)")


def build_sglang_command(a: SGLangArgs, python: str = sys.executable) -> list[str]:
    """The argv of one SGLang server. The API key is NOT in it (`ps` shows every argv): SGLang reads it
    from the ``--config`` YAML file ``api_key_config`` (write_key_config makes one, mode 0600)."""
    check_args(a)
    cmd = [python, "-m", "sglang.launch_server",
           "--model-path", a.model_path, "--host", a.host, "--port", str(a.port),
           "--tp-size", str(a.tp), "--ep-size", str(a.ep),
           "--mem-fraction-static", str(a.mem_fraction),
           "--base-gpu-id", str(a.base_gpu_id),
           "--enable-return-routed-experts",   # routing replay needs every token's experts
           "--weight-version", "0"]            # our versions are ints; SGLang's default is "default"
    if a.dp_attention:
        # 0.5.23's DP attention: `--attn-dp-size N` (arg_groups/fields/parallel.py:81-90); the old spelling
        # `--dp-size N --enable-dp-attention` is deprecated (server_args.py:413-421) and --dp-size > 1 with
        # it is refused (arg_groups/parallel_hook.py:287-292).
        cmd += ["--attn-dp-size", str(a.dp_attention)]
    if a.indexer_topk:
        # meta_info["indexer_topk"] for indexer replay (arg_groups/fields/exec_.py:161-164); the DSA
        # attention backend and the indexer's RoPE style come from config.json (arg_groups/overrides.py
        # _deepseek_family_overrides; models/deepseek_v2.py:2118 reads indexer_rope_interleave).
        cmd += ["--enable-return-indexer-topk"]
    if a.fp8:
        # model_path is then a block-FP8 checkpoint (rollout.engine_model_path, checked by
        # trainer/engines.py): its quantization_config makes Fp8Config fp8-serialized with 128x128 blocks
        # (fp8.py:346-386) and the flag must agree with it (configs/model_config.py:2108-2147 raises
        # otherwise). On a bf16 checkpoint the flag would quantize per channel at load, replacing the
        # parameters updates load into (fp8.py:1160-1176).
        cmd += ["--quantization", "fp8"]
    if a.api_key and not a.api_key_config:
        raise ValueError("an SGLang api key travels in a --config file, not the command line; "
                         "set api_key_config (write_key_config writes one)")
    if a.api_key_config:
        cmd += ["--config", a.api_key_config]   # SGLang's YAML options file (server_args.py --config)
    if a.seed is not None:
        cmd += ["--random-seed", str(a.seed)]
    if a.model_overrides:   # set on the HF config before the model is built (utils/hf_transformers/config.py:405-411)
        cmd += ["--json-model-override-args", json.dumps(a.model_overrides, sort_keys=True)]
    cmd += list(a.extra) + list(a.engine_args)
    if a.indexer_topk:
        # With SGLANG_DSA_FUSE_TOPK on (its default, environ.py:1978) the captured top-k are page-table slots
        # on decode and batch-wide ragged offsets on prefill (layers/attention/dsa/dsa_topk_backend.py:204,
        # 218); the unfused path returns each row's logical key positions (:109, :272, :303), which replay
        # needs (docs/engines.md, "DSA indexer top-k").
        cmd = ["env", f"{DSA_UNFUSED_TOPK}=0"] + cmd
    return cmd


DSA_UNFUSED_TOPK = "SGLANG_DSA_FUSE_TOPK"   # 0: indexer top-k captured as logical positions

INDEXER_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")   # GlmMoeDsaConfig defaults index_topk to 2048


def has_indexer(hf: dict) -> bool:
    """A DSA model (GLM-5, DeepSeek-V3.2): SGLang runs its indexer when config.json has index_topk
    (configs/model_config.py:191-211 is_deepseek_dsa)."""
    return bool(hf.get("index_topk")) or hf.get("model_type") in INDEXER_MODEL_TYPES


def engine_model_config(recipe) -> dict:
    """config.json of the engines' model, else (a job rendered where the model is not yet) the recipe's named
    shape or init-model preset, else {}."""
    model_path = recipe.rollout.engine_model_path or str(recipe.model.path)
    path = Path(model_path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from checkpoints.arch import ARCHS

    family = ARCHS.get(recipe.model.arch)
    if family is None:
        return {}
    return dict(family.shapes.get(recipe.model.shape_preset) or family.presets.get(recipe.model.init_preset) or {})


def engine_seed(recipe, engine: int) -> int:
    """The sampling seed of engine `engine` (requests without their own seed), SGLang or reference server."""
    return recipe.run.seed + engine


def reference_server_args(recipe) -> list[str]:
    """`sao serve` flags of a recipe's reference-server engines (seed, host and port aside): the recipe fields
    sglang_args maps, as the reference server spells them."""
    r = recipe.rollout
    args = ["--tp", str(r.engine_tp)]   # weight-update ranks, as the trainer counts an SGLang engine's
    if recipe.weight_sync.method == "shard_writes":
        args.append("--shard-writes")   # the opt-in stand-in for per-rank writes (rollout/weights/shard_writes.py)
    if r.engine_fp8:
        args += ["--quantization", "fp8"]   # serves block-FP8 weights, takes only FP8 updates for them
    if r.engine_dtype != "fp32":
        args += ["--dtype", r.engine_dtype]   # a real train/inference mismatch against the fp32 trainer
    if has_indexer(engine_model_config(recipe)):
        args.append("--enable-return-indexer-topk")   # the DSA choices the trainer replays, only when asked, as SGLang
    return args


def sglang_args(recipe, engine: int, *, host: str, port: int, base_gpu_id: int, api_key: str = "",
                api_key_config: str = "", extra: tuple[str, ...] = ()) -> SGLangArgs:
    """SGLang arguments of engine `engine` of a recipe: the one mapping from recipe fields to flags.
    A DSA model gets indexer top-k returned and, when rollout.engine_dp_attention is 0, DP attention
    across the engine (check_args names the field when another value is set)."""
    r = recipe.rollout
    hf = engine_model_config(recipe)
    indexer = has_indexer(hf)
    dp_attention = r.engine_dp_attention or (r.engine_tp if indexer and r.engine_tp > 1 else 0)
    overrides, engine_args = model_overrides(hf, tuple(r.engine_args))
    return SGLangArgs(model_path=r.engine_model_path or str(recipe.model.path), host=host, port=port,
                      api_key=api_key, api_key_config=api_key_config, tp=r.engine_tp, ep=r.engine_ep,
                      dp_attention=dp_attention, fp8=r.engine_fp8, mem_fraction=r.mem_fraction,
                      base_gpu_id=base_gpu_id, seed=engine_seed(recipe, engine), indexer_topk=indexer, extra=extra,
                      model_overrides=overrides, engine_args=engine_args)


OVERRIDE_FLAG = "--json-model-override-args"


def model_overrides(hf: dict, engine_args: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
    """(config overrides for the engine, engine_args without an override flag of their own, merged in).

    GLM-5's indexer RoPE: transformers' GlmMoeDsa (which the trainer and the reference server follow)
    always rotates the indexer's q and k as interleaved pairs (modeling_glm_moe_dsa.py:220-221); SGLang 0.5.23
    does so only when the config says indexer_rope_interleave, else half-split (models/deepseek_v2.py:2118).
    A glm_moe_dsa config.json without that key gets it set, so the engine's indexer selects as the trainer's
    would; an explicit value in config.json or in engine_args' own --json-model-override-args is kept."""
    overrides: dict = {}
    if hf.get("model_type") == "glm_moe_dsa" and "indexer_rope_interleave" not in hf:
        overrides["indexer_rope_interleave"] = True
    rest: list[str] = []
    i = 0
    while i < len(engine_args):
        arg = engine_args[i]
        flag, eq, value = arg.partition("=")
        if flag == OVERRIDE_FLAG:
            if not eq:
                i += 1
                value = engine_args[i] if i < len(engine_args) else "{}"
            overrides.update(json.loads(value))
        else:
            rest.append(arg)
        i += 1
    return overrides, tuple(rest)


def args_from_recipe(recipe, index: int, port: int, api_key: str) -> SGLangArgs:
    """Engine `index` started on this node (`sao train`): its GPUs follow the previous engines'."""
    return sglang_args(recipe, index, host=recipe.rollout.host, port=port, base_gpu_id=index * recipe.rollout.engine_tp,
                       api_key=api_key)


def check_fp8_engine_gpu(capability: tuple[int, int], name: str) -> None:
    """RuntimeError naming the GPU where SGLang 0.5.23 turns block-FP8 scales into UE8M0 at first load: DeepGEMM
    with UE8M0 scales on SM100/SM103 and SM120/SM121 (layers/deep_gemm_wrapper/configurer.py:58-60) requantises
    each 128x128 block to a power-of-two scale and repacks the scales into DeepGEMM's int32 layout
    (layers/quantization/fp8_utils.py:2147-2181, 2258-2281, 2394-2417, called from fp8.py:837 and :2281). Our
    updates carry amax/448 fp32 scales in the checkpoint's layout, which that parameter no longer has, and the
    `format_ue8m0` mark skips the requantisation after a reload. rollout.engine_gpu refuses this at check time."""
    if capability[0] == 10 or capability in ((12, 0), (12, 1)):
        raise RuntimeError(f"rollout.engine_fp8: this engine's GPU is {name} (SM{capability[0]}{capability[1]}), where "
                           "SGLang 0.5.23 re-quantises FP8 block scales to UE8M0 at load and weight updates would "
                           "land in the wrong form; fix: set rollout.engine_fp8 = false or run the engines on Hopper")


def fp8_gpu_guard(index: int = 0) -> int:
    """`sao launch`'s rollout-node check before FP8 engines start: 0, or 2 after one line on stderr."""
    try:
        check_fp8_engine_gpu(*_gpu_of(index))
    except RuntimeError as err:
        print(f"rollout node: {err}", file=sys.stderr)
        return 2
    return 0


def _gpu_of(index: int) -> tuple[tuple[int, int], str]:
    import torch   # only here: the launcher starts SGLang on a CUDA machine, which has torch

    return tuple(torch.cuda.get_device_capability(index)), torch.cuda.get_device_name(index)


def write_key_config(path: str | Path, api_key: str) -> Path:
    """The YAML options file (JSON is YAML) holding only ``api-key``, readable by this user alone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)    # an existing file keeps its mode through O_CREAT: narrow it before writing
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({"api-key": api_key}) + "\n")
    return path


@dataclass
class SGLangServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (SGLang forks schedulers), then SIGKILL after timeout_s.
        When the server itself has exited already (a crash the trainer restarts), its schedulers may
        still hold the GPU and the port: the group is killed anyway."""
        if self.process.poll() is not None:
            _signal_group(self.process, signal.SIGKILL)
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)   # the server was started in its own session: pgid == pid
    except ProcessLookupError:
        pass


def launch_sglang(recipe, index: int, port: int, api_key: str, log_path: str | Path,
                  timeout_s: float = 1200.0) -> SGLangServer:
    """Start engine `index` of the recipe, stream its log to `log_path`, wait for /health."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("rollout.engine = 'sglang' needs SGLang on a CUDA machine: "
                           "pip install 'sglang==0.5.23' (or use rollout.engine = 'reference' on CPU)")
    args = args_from_recipe(recipe, index, port or free_port(recipe.rollout.host), api_key)
    if args.fp8:
        check_fp8_engine_gpu(*_gpu_of(args.base_gpu_id))
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if api_key:
        args.api_key_config = str(write_key_config(log_path.with_name(log_path.stem + "_options.yaml"), api_key))
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(build_sglang_command(args), stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = SGLangServer(url=f"http://{args.host}:{args.port}", process=process, log_path=log_path)
    try:
        wait_healthy(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server, timeout_s: float, label: str = "SGLang", poll_s: float = 1.0) -> None:
    """Poll /health of a spawned engine (anything with .process, .url, .log_path, .log_tail()) until 200.

    RuntimeError with the log tail if the process dies or time runs out. Shared by SGLang and the
    reference server's `launch_local`.
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{label} exited with code {server.process.returncode}; log {server.log_path}:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last = str(err)
        time.sleep(poll_s)
    raise RuntimeError(f"{label} at {server.url} not healthy within {timeout_s:.0f}s ({last}); "
                       f"log {server.log_path}:\n{server.log_tail()}")