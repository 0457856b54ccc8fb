"""Prompt sources: datasets from local files or the built-in tasks, with a resumable cursor.

`build_prompt_source(cfg, tokenizer, seed)` returns a `PromptSource` whose `next()` yields
`Prompt`s forever: rows are visited in a seeded permutation per epoch (epoch e uses
``Random(seed * 1_000_003 + e)``), so the stream is reproducible and `state_dict()` (epoch,
position, prompts drawn) restores it exactly.

Datasets: ``.jsonl`` (one JSON object per line), ``.json`` (a list), ``.parquet``, a directory
written by HF ``datasets.save_to_disk``, or any other local directory ``datasets.load_dataset`` reads
(data files, a dataset repository's snapshot in the HF cache; split ``rollout.dataset_split``); a
local path is never fetched from the hub. Each row needs the prompt field ``rollout.prompt_key``
(default ``prompt``: a string, or a list of chat messages ``{"role", "content"}``); ``rollout.label_key``
(default: ``answer``, else ``label``) becomes the label; other fields go to metadata. Chat-template
options: ``rollout.system_prompt`` (a system message first unless the row has one) and
``rollout.enable_thinking`` / ``rollout.chat_template_kwargs``, passed to ``apply_chat_template``.
A bad row (not JSON, no prompt, too long after templating) is reported with its line number and
skipped, or fails the run, by ``rollout.bad_row``; never silently.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


class BadRowError(ValueError):
    """A dataset row cannot be used and rollout.bad_row is 'fail'."""


@dataclass
class Prompt:
    prompt_index: int        # position in the prompt stream (monotonic across epochs)
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict = field(default_factory=dict)


@dataclass
class Row:
    line: int                # 1-based line (jsonl) or row number (parquet, generated)
    prompt: Any              # str or list of chat messages
    label: Any = None
    metadata: dict = field(default_factory=dict)


class PromptSource:
    """An endless, seeded, resumable stream of tokenized prompts over a list of rows."""

    def __init__(self, rows: list[Row], tokenizer, seed: int, *, max_prompt_len: int = 256,
                 bad_row: str = "skip", chat_template: bool = True, shuffle: bool = True,
                 name: str = "prompts", system_prompt: str = "", template_kwargs: Optional[dict] = None):
        if not rows:
            raise ValueError(f"{name}: no usable rows; check rollout.dataset / rollout.task")
        self.rows, self.tokenizer, self.seed = rows, tokenizer, seed
        self.max_prompt_len, self.bad_row, self.name = max_prompt_len, bad_row, name
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.shuffle = shuffle
        self.system_prompt, self.template_kwargs = system_prompt, dict(template_kwargs or {})
        self.epoch, self.position, self.drawn = 0, 0, 0
        self.bad_rows: dict[int, str] = {}   # line -> reason, reported once each
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        """The next usable prompt; moves to the next epoch (reshuffled) at the end of the rows."""
        for _ in range(len(self.rows) + 1):
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            row = self.rows[self._order[self.position]]
            self.position += 1
            if row.line in self.bad_rows:
                continue
            encoded = self._encode(row)
            if encoded is None:
                continue
            ids, text = encoded
            prompt = Prompt(self.drawn, ids, text, row.label, dict(row.metadata, epoch=self.epoch, line=row.line))
            self.drawn += 1
            return prompt
        raise ValueError(f"{self.name}: every row is bad ({len(self.bad_rows)} reported); fix the dataset")

    def _encode(self, row: Row) -> Optional[tuple[list[int], str]]:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + list(messages)
        if self.chat_template or isinstance(row.prompt, list):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **self.template_kwargs)
        else:   # no template: the system prompt is a line of its own before the prompt
            text = f"{self.system_prompt}\n{row.prompt}" if self.system_prompt else row.prompt
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > self.max_prompt_len:
            self.report_bad(row.line, f"prompt has {len(ids)} tokens > rollout.max_prompt_len {self.max_prompt_len}")
            return None
        return ids, text

    def report_bad(self, line: int, reason: str) -> None:
        report_bad_row(self.name, line, reason, self.bad_row)
        self.bad_rows[line] = reason

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn,
                "num_rows": len(self.rows), "bad_rows": {str(k): v for k, v in self.bad_rows.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.rows):
            raise ValueError(f"{self.name}: checkpoint cursor is for {state['num_rows']} rows, the source has "
                             f"{len(self.rows)}; resume with the same dataset/task settings")
        self.epoch, self.position, self.drawn = state["epoch"], state["position"], state["drawn"]
        self.bad_rows = {int(k): v for k, v in state.get("bad_rows", {}).items()}
        self._order = self._permutation(self.epoch)


def report_bad_row(name: str, line: int, reason: str, policy: str) -> None:
    message = f"{name}: bad row at line {line}: {reason}"
    if policy == "fail":
        raise BadRowError(message + " (rollout.bad_row='fail'; set it to 'skip' to skip such rows)")
    log.warning("%s; skipped (rollout.bad_row='skip')", message)


def _row_from_record(record: Any, line: int, prompt_key: str = "prompt", label_key: str = "") -> Row:
    if not isinstance(record, dict):
        raise ValueError(f"row is {type(record).__name__}, expected an object")
    prompt = record.get(prompt_key)
    if isinstance(prompt, list) and prompt:
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError(f"{prompt_key!r} list must hold {{'role', 'content'}} messages")
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"missing or empty {prompt_key!r} field (rollout.prompt_key)")
    label_keys = (label_key,) if label_key else ("answer", "label")
    label = next((record[k] for k in label_keys if k in record), None)
    meta = {k: v for k, v in record.items() if k not in (prompt_key, *label_keys)}
    return Row(line, prompt, label, meta)


def _records(path: Path, bad_row: str, split: str = "train"):
    """(line, record-or-exception) pairs of a dataset file."""
    if path.is_dir():
        yield from enumerate(_hf_directory(path, split), start=1)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"rollout.dataset {path}: a .json file must hold a list of rows")
        yield from enumerate(data, start=1)
    elif path.suffix == ".jsonl":
        with path.open() as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield line_no, ValueError(f"not valid JSON ({exc.msg})")
    else:
        raise ValueError(f"rollout.dataset {path}: unknown format {path.suffix!r}; use .jsonl, .json, .parquet "
                         "or an HF datasets directory")


def _hf_directory(path: Path, split: str):
    """A local HF dataset: save_to_disk's layout (load_from_disk), else whatever load_dataset reads
    from a directory (data files, or a repository snapshot in the HF cache,
    ~/.cache/huggingface/hub/datasets--ORG--NAME/snapshots/REV). A local path is read with the packaged
    builders (json, parquet, csv, ...), never from the hub."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"rollout.dataset {path} is a directory (HF datasets format); "
                          "pip install datasets, or give a .jsonl/.parquet file") from exc
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        data = datasets.load_from_disk(str(path))
    else:
        data = datasets.load_dataset(str(path))
    if isinstance(data, (datasets.DatasetDict, dict)):
        if split not in data:
            raise ValueError(f"rollout.dataset {path} has no split {split!r} (it has {', '.join(data)}); "
                             "set rollout.dataset_split")
        data = data[split]
    return data


def load_rows(path: str, bad_row: str = "skip", *, prompt_key: str = "prompt", label_key: str = "",
              split: str = "train") -> list[Row]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"rollout.dataset {path} does not exist")
    rows = []
    for line, record in _records(p, bad_row, split):
        try:
            if isinstance(record, Exception):
                raise record
            rows.append(_row_from_record(record, line, prompt_key, label_key))
        except ValueError as exc:
            report_bad_row(str(p), line, str(exc), bad_row)
    return rows


def task_rows(task: str, seed: int, num_problems: int, switch_every: int = 50, rules: tuple = ()) -> list[Row]:
    """`num_problems` generated problems of a built-in task (deterministic in seed); `rules`: the online
    task's rule cycle (() = its default)."""
    from rollout.rewards.environments import DEFAULT_RULES, ChangingEnvironment
    from rollout.rewards.tasks import get_task

    online = task == "online"
    make = ChangingEnvironment(switch_every, tuple(rules) or DEFAULT_RULES).make if online else get_task(task).make
    rng = random.Random(seed)
    rows = []
    for i in range(num_problems):
        problem = make(rng)
        rows.append(Row(i + 1, problem.text, problem.label, dict(problem.metadata)))
    return rows


def build_prompt_source(cfg, tokenizer, seed: int, *, num_problems: int = 4096, switch_every: Optional[int] = None,
                        chat_template: bool = True) -> PromptSource:
    """The recipe's prompts: ``cfg.dataset`` if set, else the built-in ``cfg.task``.

    ``switch_every`` is the online environment's phase length in trainer steps (default
    ``cfg.env_switch_every``, else 50); ``chat_template`` wraps string prompts in the tokenizer's
    chat template (when it has one).
    """
    if switch_every is None:
        switch_every = getattr(cfg, "env_switch_every", 50)
    if cfg.dataset:
        rows = load_rows(cfg.dataset, cfg.bad_row, prompt_key=getattr(cfg, "prompt_key", "prompt"),
                         label_key=getattr(cfg, "label_key", ""), split=getattr(cfg, "dataset_split", "train"))
        name = cfg.dataset
    else:
        rules = tuple(getattr(cfg, "env_rules", ()) or ())
        rows, name = task_rows(cfg.task, seed, num_problems, switch_every, rules), f"task {cfg.task}"
    return PromptSource(rows, tokenizer, seed, max_prompt_len=cfg.max_prompt_len, bad_row=cfg.bad_row,
                        chat_template=chat_template, name=name, system_prompt=getattr(cfg, "system_prompt", ""),
                        template_kwargs=template_kwargs(cfg))


def template_kwargs(cfg) -> dict:
    """Extra apply_chat_template arguments: rollout.chat_template_kwargs plus enable_thinking when set
    (Qwen3's template reads it; templates ignore names they do not use)."""
    kwargs = dict(getattr(cfg, "chat_template_kwargs", {}) or {})
    if getattr(cfg, "enable_thinking", None) is not None:
        kwargs["enable_thinking"] = cfg.enable_thinking
    return kwargs
