"""Behaviour contract for DSA indexer top-k: SGLang 0.5.23's request field, server flag and reply
format, and what its values mean, pinned from the wheel's source (never imported). The reference
server and the client copy the format (rollout/engines/indexer_topk.py); docs/engines.md "DSA indexer top-k"
cites these places. Paths are relative to sglang/srt/.
"""
from __future__ import annotations

import argparse
import ast

import torch
from sglang_cli import wheel_flags
from sglang_wheel import IO_STRUCT, function, source

from rollout.engines import indexer_topk
from rollout.engines.reference_server import protocol
from rollout.engines.reference_server.server import add_arguments
from rollout.engines.sglang_client import META_INFO_FIELDS, ROUTES

CAPTURER = "state_capturer/indexer_topk.py"
COLLECT = "managers/scheduler_components/batch_result_processor.py"
STREAMER = "managers/scheduler_components/output_streamer.py"
DSA_INDEXER = "layers/attention/dsa/dsa_indexer.py"
TOPK_BACKEND = "layers/attention/dsa/dsa_topk_backend.py"


def code(path: str, qualname: str) -> str:
    return ast.unparse(function(path, qualname))


def _class_lines(path: str, cls: str) -> list[str]:
    node = next(n for n in ast.parse(source(path)).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [ast.unparse(s) for s in node.body if isinstance(s, ast.AnnAssign)]


def test_request_field_and_server_flag():
    assert "return_indexer_topk: bool = False" in _class_lines(IO_STRUCT, "GenerateReqInput")
    assert wheel_flags()["--enable-return-indexer-topk"] == [0, "enable_return_indexer_topk"]   # store-true
    assert "return_indexer_topk" in protocol.GENERATE_FIELDS and "return_indexer_topk" in ROUTES["/generate"][2]
    assert "indexer_topk" in META_INFO_FIELDS
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--enable-return-indexer-topk"]).enable_return_indexer_topk is True
    assert parser.parse_args(["--model", "m"]).enable_return_indexer_topk is False


def test_reply_is_base64_int32_of_tokens_minus_one_by_layers_by_topk():
    # tokenizer_manager.py: meta_info["indexer_topk"] only when the request's value is not None
    tm = source("managers/tokenizer_manager.py")
    assert 'meta_info["indexer_topk"] = val' in tm
    assert "indexer_topk = self._b64_encode_per_request(recv_obj.indexer_topk)" in source(
        "managers/detokenizer_manager.py")
    assert "pybase64.b64encode(item.numpy().tobytes())" in code("managers/detokenizer_manager.py",
                                                                "DetokenizerManager._b64_encode_per_request")
    extract = code(CAPTURER, "extract_indexer_topk_from_meta_info")
    assert "dtype=np.int32" in extract
    assert "(seqlen-1, num_indexer_layers" in source(CAPTURER)                 # the documented shape
    assert "dtype=torch.int32" in code("state_capturer/base.py", "BaseHostCache.__init__")
    # rows [start_len, seqlen - 1) of the request's tokens; the indexer collector passes no start_len
    assert "[start_len:seqlen - 1]" in code("state_capturer/base.py", "BaseTopkCapturer.get_topk")
    collect = code(COLLECT, "SchedulerBatchResultProcessor._maybe_collect_indexer_topk")
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in collect
    assert "start_len" not in collect


def test_layer_axis_is_every_hidden_layer_and_shared_layers_mirror():
    layers = code("configs/model_config.py", "get_num_indexer_layers")
    assert "if is_deepseek_dsa(config):\n        return config.num_hidden_layers" in layers
    assert "topk_size=self.index_topk" in code(CAPTURER, "IndexerTopkCapturer.__init__")
    mla = source("models/deepseek_common/attention_forward_methods/forward_mla.py")
    assert "maybe_capture_indexer_topk(\n                        self.layer_id, prev_topk_indices" in mla
    # a plain DeepSeek-V3 (no index_topk) is not a DSA model: no capturer, no field
    assert "_hf_attr(config, 'index_topk') is not None" in code("configs/model_config.py", "is_deepseek_dsa")


def test_no_flag_means_no_field_and_dp_attention_on_cuda_only():
    raw = code(CAPTURER, "_create_indexer_capturer_raw")
    assert raw.splitlines()[1].strip() == "if not enable:" and "return None" in raw.splitlines()[2]
    collect = code(COLLECT, "SchedulerBatchResultProcessor._maybe_collect_indexer_topk")
    assert "if capturer is None:\n        return" in collect
    assert "req.indexer_topk if req.return_indexer_topk else None" in source(STREAMER)
    assert "assert attn_tp_size == 1" in code(CAPTURER, "IndexerTopkCapturer.__init__")
    assert "if enable and device != 'cuda' and (device != 'npu'):" in code(CAPTURER, "create_indexer_capturer")


def test_values_are_captured_after_the_top_k_transform():
    """Not logical positions by default: the capture sees the output of metadata.topk_transform,
    which with SGLANG_DSA_FUSE_TOPK=1 (the default) maps positions to page-table (KV pool) slots on
    decode (PAGED) and to ragged-batch offsets on prefill (RAGGED). Unfused, it returns positions
    relative to each row's start (logical), -1 padded."""
    forward = code(DSA_INDEXER, "Indexer.forward_cuda")
    assert "topk_result = self._get_topk_paged(" in forward and "topk_result = self._get_topk_ragged(" in forward
    assert forward.rstrip().endswith("return maybe_capture_indexer_topk(layer_id, topk_result)")
    assert "metadata.topk_transform(logits, self.index_topk)" in code(DSA_INDEXER, "Indexer._get_topk_paged")
    assert "SGLANG_DSA_FUSE_TOPK = EnvBool(True)" in source("environ.py")
    transform = code(TOPK_BACKEND, "DSATopKBackend.topk_transform")
    assert transform.splitlines()[1].strip() == "if not envs.SGLANG_DSA_FUSE_TOPK.get() or force_unfused_topk:"
    assert "fast_topk_transform_fused(" in transform and "fast_topk_transform_ragged_fused(" in transform
    enum = ast.unparse(next(n for n in ast.parse(source(TOPK_BACKEND)).body
                            if isinstance(n, ast.ClassDef) and n.name == "TopkTransformMethod"))
    assert "PAGED" in enum and "RAGGED" in enum
    assert "# Transform topk indices to indices to the page table" in source(TOPK_BACKEND)
    unfused = code(TOPK_BACKEND, "_topk_unfused")
    assert "score.new_full((batch_size, topk), -1, dtype=torch.int32)" in unfused
    assert "topk_col_indices.to(torch.int32) - row_starts_unsqueezed" in unfused
    assert "masked_fill(topk_scores == float('-inf'), -1)" in unfused
    # our side: what cannot be a logical position is refused by the client (test_indexer_topk_client.py)
    assert indexer_topk.logical_violation(torch.tensor([[[0]], [[5]]])) is not None
