"""Writes tool_sft.jsonl: SFT transcripts that teach the tiny model the python-tool protocol
(recipes/tiny_agent_cpu.toml). Each row's response is a whole two-turn episode as the agent builds it
(rollout/agents/tool_loop.py): a python call that computes the problem, the tool's output exactly as the agent
appends it, then a submit call with that output. SFT trains on all of it (the observation too), which
is a warm start only; RL then trains the actions alone (observations have loss_mask 0).

    python data/agent/make_tool_sft.py    # deterministic: the same file every time
"""
import json
from pathlib import Path

from rollout.prompts import task_rows


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def transcript(problem: str, answer: str) -> str:
    expression = problem.rstrip("=")
    observation = f"\n<tool_response>{answer}\n</tool_response>\n"      # print's output, as ToolAgent appends it
    return call("python", {"code": f"print({expression})"}) + observation + call("submit", {"answer": answer})


def main() -> None:
    # the training side only: the held-out problems (chain:1:1:eval) stay unseen until eval
    rows = task_rows("chain:1:1:train", seed=20_000, num_problems=512)   # a seed apart from RL's prompts
    out = Path(__file__).with_name("tool_sft.jsonl")
    with out.open("w") as fh:
        for row in rows:
            fh.write(json.dumps({"prompt": row.prompt, "response": transcript(row.prompt, str(row.label))}) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
