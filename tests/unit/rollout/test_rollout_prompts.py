"""Prompt sources: datasets, bad rows, chat templating, epochs and the resumable cursor."""
from __future__ import annotations

import json

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.prompts import BadRowError, build_prompt_source, load_rows
from sao_megatron.core.config.schema import RolloutConfig

TOK = build_tokenizer()


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_rows_are_templated_and_labelled(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2", "source": "x"}),
                                               json.dumps({"prompt": [{"role": "user", "content": "hi"}]})])
    src = build_prompt_source(RolloutConfig(dataset=path, task=""), TOK, seed=0)
    prompts = [src.next() for _ in range(2)]
    by_text = {p.prompt_text: p for p in prompts}
    p = by_text["<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"]
    assert p.label == "2" and p.metadata["source"] == "x" and p.metadata["line"] == 1
    assert TOK.decode(p.prompt_ids) == p.prompt_text
    assert [q.prompt_index for q in prompts] == [0, 1]


def test_bad_rows_are_reported_with_line_and_skipped(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "ok"}', "{not json", '{"answer": "3"}', '{"prompt": "ok2"}'])
    rows = load_rows(path, "skip")
    assert [r.line for r in rows] == [1, 4]
    assert "line 2" in caplog.text and "line 3" in caplog.text and "missing or empty 'prompt'" in caplog.text


def test_bad_row_policy_fail_raises_naming_the_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "ok"}', "{not json"])
    with pytest.raises(BadRowError, match="line 2"):
        load_rows(path, "fail")


def test_overlong_prompt_is_skipped_at_draw_time(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "x" * 300}), json.dumps({"prompt": "short"})])
    src = build_prompt_source(RolloutConfig(dataset=path, task="", max_prompt_len=64), TOK, seed=0)
    assert all(src.next().metadata["line"] == 2 for _ in range(3))
    assert 1 in src.bad_rows and "max_prompt_len" in src.bad_rows[1]


def test_parquet_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    rows = load_rows(str(tmp_path / "d.parquet"))
    assert [(r.prompt, r.label, r.line) for r in rows] == [("a", "1", 1), ("b", "2", 2)]


def test_hf_datasets_folder(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2", "source": "x"}, {"prompt": "", "answer": "0"},
                                {"prompt": "2+2=", "answer": "4", "source": "y"}]).save_to_disk(str(tmp_path / "hf"))
    rows = load_rows(str(tmp_path / "hf"))  # the empty prompt (row 2) is reported and skipped
    assert [(r.prompt, r.label, r.line, r.metadata["source"]) for r in rows] == [("1+1=", "2", 1, "x"), ("2+2=", "4", 3, "y")]
    src = build_prompt_source(RolloutConfig(dataset=str(tmp_path / "hf"), task=""), TOK, seed=0)
    assert {src.next().label for _ in range(2)} == {"2", "4"}


def test_epochs_cover_every_row_once_and_reshuffle():
    src = build_prompt_source(RolloutConfig(task="arithmetic"), TOK, seed=3, num_problems=10)
    first = [src.next().metadata["line"] for _ in range(10)]
    second = [src.next().metadata["line"] for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(1, 11))
    assert first != second and src.epoch == 1


def test_cursor_resume_continues_the_same_stream():
    cfg = RolloutConfig(task="countdown")
    a = build_prompt_source(cfg, TOK, seed=1, num_problems=7)
    for _ in range(9):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(12)]
    b = build_prompt_source(cfg, TOK, seed=1, num_problems=7)
    b.load_state_dict(state)
    got = [b.next() for _ in range(12)]
    assert [(p.prompt_index, p.prompt_ids, p.label) for p in got] == [(p.prompt_index, p.prompt_ids, p.label) for p in expected]


def test_cursor_for_another_dataset_is_refused():
    a = build_prompt_source(RolloutConfig(task="copy"), TOK, seed=1, num_problems=7)
    b = build_prompt_source(RolloutConfig(task="copy"), TOK, seed=1, num_problems=8)
    with pytest.raises(ValueError, match="7 rows"):
        b.load_state_dict(a.state_dict())


def test_unknown_task_names_the_field():
    with pytest.raises(ValueError, match="rollout.task: unknown task 'chess'"):
        build_prompt_source(RolloutConfig(task="chess"), TOK, seed=0)


def test_plain_prompts_without_chat_template_are_short():
    src = build_prompt_source(RolloutConfig(task="arithmetic"), TOK, seed=0, chat_template=False)
    p = src.next()
    assert p.prompt_text.endswith("=") and len(p.prompt_ids) == len(p.prompt_text) <= 4


def test_online_task_takes_the_switch_period_from_the_config():
    src = build_prompt_source(RolloutConfig(task="online", env_switch_every=7), TOK, seed=0, num_problems=4)
    p = src.next()
    assert p.metadata["switch_every"] == 7 and p.metadata["task"] == "online" and len(p.label) == 1
