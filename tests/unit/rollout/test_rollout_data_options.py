"""Data options of a recipe (issue 28.5): dataset field names, chat-template options, HF dataset
directories, eval sampling of its own, eval registration by import path, and one-line errors."""
from __future__ import annotations

import json

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.prompts import build_prompt_source, load_rows
from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.core.config.schema import EvalConfig, RolloutConfig
from sao_megatron.evaluation.runner import AgenticEval, agentic_eval_for, encode_prompt, eval_sampling

RECIPE = "recipes/tiny_moe_cpu.toml"
# renders what the options reach: the system message, enable_thinking and a custom kwarg
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined %}<think={{ enable_thinking }}>{% endif %}"
            "{% if style is defined %}<style={{ style }}>{% endif %}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_and_label_keys_name_the_dataset_fields(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "gold": "2", "answer": "x", "src": "a"}])
    rows = load_rows(data, prompt_key="question", label_key="gold")
    assert rows[0].prompt == "1+1=" and rows[0].label == "2"
    assert rows[0].metadata == {"answer": "x", "src": "a"}          # the other fields stay metadata
    with pytest.raises(Exception, match="'question'"):              # a row without the prompt field is named
        load_rows(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}]), bad_row="fail", prompt_key="question")


def test_system_prompt_enable_thinking_and_template_kwargs_reach_the_chat_template(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    cfg = RolloutConfig(dataset=write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "1"}]),
                        system_prompt="be brief", enable_thinking=False, chat_template_kwargs={"style": "terse"})
    prompt = build_prompt_source(cfg, tok, seed=0).next()
    assert prompt.prompt_text == "[system]be brief[user]hi<think=False><style=terse>"
    # evaluation encodes held-out prompts with the same options
    assert tok.decode(encode_prompt(tok, "hi", cfg)) == prompt.prompt_text


def test_hf_dataset_directories_load_without_the_network(tmp_path):
    datasets = pytest.importorskip("datasets")
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl", [{"text": "2+2=", "label": "4"}, {"text": "3+3=", "label": "6"}])
    rows = load_rows(str(files), prompt_key="text")                 # load_dataset on a local directory
    assert [(r.prompt, r.label) for r in rows] == [("2+2=", "4"), ("3+3=", "6")]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "5-1=", "answer": "4"}]).save_to_disk(str(saved))
    assert [(r.prompt, r.label) for r in load_rows(str(saved))] == [("5-1=", "4")]
    with pytest.raises(ValueError, match="rollout.dataset_split"):
        load_rows(str(files), prompt_key="text", split="test")


def test_eval_sampling_is_its_own_and_falls_back_to_rollout():
    rollout = RolloutConfig(temperature=1.0, top_p=0.9, max_new_tokens=64)
    assert eval_sampling(EvalConfig(), rollout) == (1.0, 0.9, 64)
    assert eval_sampling(EvalConfig(temperature=0.6, top_p=0.95, max_new_tokens=256), rollout) == (0.6, 0.95, 256)


class OwnEval(AgenticEval):
    name = "own"

    def __init__(self, arg):
        self.arg = arg

    @classmethod
    def from_source(cls, arg, eval_cfg, rollout_cfg, context_length=None):
        return cls(arg)

    def problems(self):
        return []

    async def run_episode(self, engine, tokenizer, problem, seed):
        raise NotImplementedError


def test_an_eval_registered_by_import_path_in_the_recipe_is_built(tmp_path):
    tasks = write_jsonl(tmp_path / "own.jsonl", [{"id": "a"}])
    recipe = load_recipe(RECIPE, ["eval.agentic_evals={own = 'test_rollout_data_options:OwnEval'}",
                                  f"eval.datasets=['own:{tasks}']"], check_files=True)
    env = agentic_eval_for(recipe.eval.datasets[0], recipe.eval, recipe.rollout)
    assert isinstance(env, OwnEval) and env.arg == tasks


@pytest.mark.parametrize("override,field", [
    ("rollout.prompt_key=''", "rollout.prompt_key"),
    ("rollout.label_key=prompt", "rollout.label_key"),
    ("rollout.dataset_split=''", "rollout.dataset_split"),
    ("rollout.chat_template_kwargs={tokenize = true}", "rollout.chat_template_kwargs"),
    ("rollout.enable_thinking=3", "rollout.enable_thinking"),
    ("eval.temperature=0", "eval.temperature"),
    ("eval.top_p=1.5", "eval.top_p"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("eval.agentic_evals={own = 'not a path'}", "eval.agentic_evals"),
    ("eval.agentic_evals={task = 'a.b:C'}", "eval.agentic_evals"),
    ("sft.response_key=prompt", "sft.response_key"),
    ("sft.prompt_key=''", "sft.prompt_key"),
])
def test_bad_data_values_are_one_line_errors_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_recipe(RECIPE, [override], check_files=False)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_an_unimportable_registered_eval_is_refused_at_the_file_checks():
    with pytest.raises(ConfigError, match="^eval.agentic_evals"):
        load_recipe(RECIPE, ["eval.agentic_evals={own = 'no_such_module_here:Eval'}"], check_files=True)


def test_sft_keys_name_the_prompt_and_response_fields(tmp_path):
    import dataclasses

    from sao_megatron.trainer.sft import next_pair

    data = write_jsonl(tmp_path / "sft.jsonl", [{"q": "1+1=", "a": "2"}])
    recipe = load_recipe(RECIPE, [f"sft.dataset={data}", "sft.prompt_key=q", "sft.response_key=a"], check_files=False)
    tok = build_tokenizer()
    cfg = dataclasses.replace(recipe.rollout, dataset=data, prompt_key="q", label_key="a")   # as _sft_source
    prompt_ids, response = next_pair(build_prompt_source(cfg, tok, seed=0), tok, recipe)
    assert "1+1=" in tok.decode(prompt_ids) and response == tok.encode("2", add_special_tokens=False) + [tok.eos_token_id]
