"""The rollout side. At the top, the driver's data path: driver.py (RolloutDriver), buffer.py, staleness.py,
context.py, prompts.py, sample_source.py (the SampleSource seam), batch_metrics.py and dump.py. By role below:
engines/ (the servers and their clients), rewards/ (reward functions, the sandbox, environments), agents/
(multi-turn loops) and weights/ (the trainer's weights reaching the engines). docs/rollout.md.
"""
