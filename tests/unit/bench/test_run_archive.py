"""The run archive (bench/run_archive.py): a full design's finished runs are kept in the checkout and read
back on another machine only when the run they would be is the same run: same resolved recipe but for
this machine's paths, same start weights, same epoch. A damaged entry is named and rerun, never read."""
from __future__ import annotations

import gzip
import json

import pytest
import tomli_w

import bench.training_runs as training_runs
from bench import run_archive
from bench.training_runs import SFT_DEMO, _settings

OVERRIDES = ["algorithm.name='sao'", "algorithm.lr=0.0001", "run.num_steps=3", "run.seed=101"]


@pytest.fixture
def start(tmp_path):
    """A start model directory: the archive compares its weight bytes, not its path."""
    model = tmp_path / "sft" / "model"
    model.mkdir(parents=True)
    (model / "model-00001-of-00001.safetensors").write_bytes(b"weights" * 100)
    (model / "config.json").write_text('{"hidden_size": 64}')
    return model


def overrides_for(model, lr="0.0001"):
    return [f"model.path='{model}'", *[o if not o.startswith("algorithm.lr") else f"algorithm.lr={lr}" for o in OVERRIDES]]


def finish(out_root, name, overrides, done=True):
    """What `sao train` leaves for a finished run: its resolved recipe, metrics and a log closing "done:"."""
    run_dir = out_root / name
    run_dir.mkdir(parents=True)
    resolved = run_archive.resolve(SFT_DEMO, _settings(name, out_root, overrides))
    (run_dir / "resolved_recipe.toml").write_text(tomli_w.dumps(resolved))
    rows = [{"step": 0, "x": 0.0}] + [{"step": s, "rollout/accuracy": s / 3 + 1e-9} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out_root / f"{name}.log").write_text("warming up\n" + (f"done: 3 steps; run dir {run_dir}\n" if done else ""))
    (run_dir / run_archive.WALL_FILE).write_text(json.dumps({"wall_s": 42.0}))
    return run_dir


def test_an_archived_run_is_read_back_from_another_out_dir_with_its_rows_and_wall(tmp_path, start):
    name, archive = "scratch_4-sao-lr0.0001-s101", tmp_path / "archive"
    run_dir = finish(tmp_path / "machine_a", name, overrides_for(start))
    path = run_archive.record(archive, name, run_dir, tmp_path / "machine_a" / f"{name}.log", 42.0, commit="abc1234")
    assert path == archive / f"{name}.json.gz" and not list(archive.glob("*.partial"))
    entry = json.loads(gzip.decompress(path.read_bytes()))
    assert entry["commit"] == "abc1234" and entry["done"].startswith("done: ") and entry["epoch"] == run_archive.EPOCH
    rows, wall = run_archive.lookup(archive, name, SFT_DEMO, _settings(name, tmp_path / "machine_b", overrides_for(start)))
    assert [r["step"] for r in rows] == [1, 2, 3] and wall == 42.0
    assert rows[0]["rollout/accuracy"] == pytest.approx(1 / 3, rel=1e-6) and rows[0]["rollout/accuracy"] == 0.333333


def test_another_setting_other_weights_or_another_epoch_is_not_read_back(tmp_path, start, monkeypatch):
    name, archive = "run", tmp_path / "archive"
    run_dir = finish(tmp_path / "a", name, overrides_for(start))
    run_archive.record(archive, name, run_dir, tmp_path / "a" / f"{name}.log", 1.0, commit="x")
    settings = _settings(name, tmp_path / "b", overrides_for(start))
    assert run_archive.lookup(archive, name, SFT_DEMO, settings) is not None
    assert run_archive.lookup(archive, name, SFT_DEMO, _settings(name, tmp_path / "b", overrides_for(start, "0.0003"))) is None
    assert run_archive.lookup(archive, "another_name", SFT_DEMO, settings) is None
    monkeypatch.setattr(run_archive, "EPOCH", run_archive.EPOCH + 1)        # a trainer fix voided the runs before it
    assert run_archive.lookup(archive, name, SFT_DEMO, settings) is None
    monkeypatch.undo()
    (start / "model-00001-of-00001.safetensors").write_bytes(b"other weights")   # same path, another start
    assert run_archive.lookup(archive, name, SFT_DEMO, settings) is None


def test_a_damaged_entry_is_named_and_the_run_is_run_again_and_rearchived(tmp_path, start, monkeypatch, capsys):
    name, archive = "run", tmp_path / "archive"
    archive.mkdir()
    (archive / f"{name}.json.gz").write_bytes(b"\x1f\x8b not really gzip")
    ran = []

    def train_run(run_name, overrides, out_root, timeout_s, recipe):
        ran.append(run_name)
        finish(out_root, run_name, overrides)
        return [{"step": 1, "rollout/accuracy": 0.5}]

    monkeypatch.setattr(training_runs, "train_run", train_run)
    rows = training_runs.run_all([(name, overrides_for(start))], tmp_path / "out", recipe=SFT_DEMO, resume=True,
                                 archive=archive)
    assert ran == [name] and rows[name] == [{"step": 1, "rollout/accuracy": 0.5}]
    assert f"{archive / name}.json.gz is damaged" in capsys.readouterr().err
    assert run_archive.read_entry(archive / f"{name}.json.gz")["name"] == name      # written anew


def test_run_all_archives_each_run_and_a_new_machine_reads_them_back_without_running(tmp_path, start, monkeypatch):
    archive, ran = tmp_path / "archive", []

    def train_run(run_name, overrides, out_root, timeout_s, recipe):
        ran.append(run_name)
        finish(out_root, run_name, overrides)
        return [{"step": s} for s in (1, 2, 3)]

    monkeypatch.setattr(training_runs, "train_run", train_run)
    specs = [("first-lr0.0001-s1", overrides_for(start)), ("second-lr0.0003-s1", overrides_for(start, "0.0003"))]
    training_runs.run_all(specs, tmp_path / "a", recipe=SFT_DEMO, archive=archive)
    assert ran == ["first-lr0.0001-s1", "second-lr0.0003-s1"]
    assert sorted(p.name for p in archive.iterdir()) == ["first-lr0.0001-s1.json.gz", "second-lr0.0003-s1.json.gz"]
    ran.clear()
    reused, walls = [], {}
    rows = training_runs.run_all(specs, tmp_path / "b", recipe=SFT_DEMO, resume=True, archive=archive,
                                 reused=reused, walls=walls)
    assert ran == [] and sorted(reused) == sorted(n for n, _ in specs)
    assert [r["step"] for r in rows["second-lr0.0003-s1"]] == [1, 2, 3] and set(walls) == {n for n, _ in specs}


def test_a_run_finished_before_the_archive_existed_is_archived_when_read_back(tmp_path, start, monkeypatch):
    archive, name = tmp_path / "archive", "old-lr0.0001-s1"
    finish(tmp_path / "out", name, overrides_for(start))
    monkeypatch.setattr(training_runs, "train_run", lambda *a, **k: pytest.fail("a finished run ran again"))
    training_runs.run_all([(name, overrides_for(start))], tmp_path / "out", recipe=SFT_DEMO, resume=True,
                          archive=archive)
    assert run_archive.read_entry(archive / f"{name}.json.gz")["wall_s"] == 42.0


def test_import_finished_takes_finished_runs_only_and_keeps_names_with_dots(tmp_path, start, capsys):
    out = tmp_path / "out"
    finish(out, "scratch_4-grpo-lr0.0001-s101", overrides_for(start))
    finish(out, "scratch_4-grpo-lr0.0003-s102", overrides_for(start, "0.0003"), done=False)   # killed mid-run
    assert run_archive.main([str(out), str(tmp_path / "archive")]) == 0
    assert [p.name for p in (tmp_path / "archive").iterdir()] == ["scratch_4-grpo-lr0.0001-s101.json.gz"]
    assert "archived 1 finished run(s)" in capsys.readouterr().out
    entry = tmp_path / "archive" / "scratch_4-grpo-lr0.0001-s101.json.gz"
    before = entry.read_bytes()
    assert run_archive.import_finished(out, tmp_path / "archive") == [] and entry.read_bytes() == before   # kept as is
    assert run_archive.main([]) == 2


def test_the_report_counts_the_full_designs_archived_runs(tmp_path, start, monkeypatch):
    """Until --full has run whole, the algorithms section says how many of its planned runs are archived."""
    import bench.algorithms as algorithms
    from bench.report_learning import _progress_text

    monkeypatch.setattr(algorithms, "ARCHIVE", tmp_path / "archive")
    assert _progress_text() == ""
    for name in ("scratch_4-sao-lr0.0001-s101", "scratch_4-sao-s1", "scratch_4-not_an_arm-s1"):
        finish(tmp_path / "out", name, overrides_for(start))
        run_archive.record(tmp_path / "archive" / "algorithms", name, tmp_path / "out" / name,
                           tmp_path / "out" / f"{name}.log", 1.0, commit="x")
    progress = algorithms.full_progress()
    assert progress["scratch:4"] == {"sweep": 42, "sweep_archived": 1, "fresh": 70, "fresh_archived": 1,
                                     "sweeps_done": {}}
    assert progress["agent"] == {"sweep": 18, "sweep_archived": 0, "fresh": 30, "fresh_archived": 0, "sweeps_done": {}}
    assert "`scratch:4` 1 of 42 sweep runs and 1 of 70 fresh-seed runs" in _progress_text()
    assert "sweeps complete so far" not in _progress_text()
    key = f"eval/task:scratch:4:eval/avg@{algorithms.EVAL_K}"
    for lr, score in zip(algorithms.LR_GRID, (0.5, 0.6, 0.1)):       # GRPO's whole sweep, best at the middle lr
        for seed in algorithms.SWEEP_SEEDS:
            entry = {"name": "x", "epoch": run_archive.EPOCH, "resolved": {}, "start_sha256": "", "wall_s": 1.0,
                     "rows": [{"step": 0}, {"step": 1, key: 0.0}, {"step": 2, key: score + (0.01 if seed == 101 else 0.03)}]}
            path = run_archive.entry_path(tmp_path / "archive" / "algorithms",
                                          algorithms.run_name("scratch:4", "grpo", seed, algorithms._lr_tag(lr)))
            path.write_bytes(gzip.compress(json.dumps(entry).encode()))
    done = algorithms.full_progress()["scratch:4"]["sweeps_done"]
    assert list(done) == ["grpo"] and done["grpo"]["chosen"] == 1e-4
    assert done["grpo"]["heldout"] == pytest.approx({"3e-05": 0.52, "0.0001": 0.62, "0.0003": 0.12})
    assert "`scratch:4` grpo: 3e-05 -> 0.520, 0.0001 -> 0.620, 0.0003 -> 0.120 (chosen 0.0001)" in _progress_text()


def sft_model(root, steps=400, weights=b"sft weights"):
    model = root / "model"
    model.mkdir(parents=True)
    (model / "model-00001-of-00001.safetensors").write_bytes(weights)
    (model / "config.json").write_text("{}")
    (model / "sao_sft.json").write_text(json.dumps({"sft": {"steps": steps}}))
    return model


def test_the_start_is_archived_once_and_restored_where_an_out_dir_has_none(tmp_path, capsys):
    archive = tmp_path / "archive"
    made = sft_model(tmp_path / "machine_a" / "sft_start_scratch_4")
    run_archive.keep_start(archive, made, "sft_start_scratch_4")
    kept = archive / "starts" / "sft_start_scratch_4"
    assert run_archive.weights_sha256(kept) == run_archive.weights_sha256(made)
    run_archive.restore_start(archive, "sft_start_scratch_4", tmp_path / "machine_b")      # a fresh machine
    restored = tmp_path / "machine_b" / "sft_start_scratch_4" / "model"
    assert run_archive.weights_sha256(restored) == run_archive.weights_sha256(kept)
    other = sft_model(tmp_path / "machine_c" / "sft_start_scratch_4", weights=b"other floating point")
    run_archive.keep_start(archive, other, "sft_start_scratch_4")       # the archived start stays, the other is named
    assert run_archive.weights_sha256(kept) == run_archive.weights_sha256(made)
    assert f"the start {other} differs from the archived" in capsys.readouterr().err
    run_archive.restore_start(archive, "sft_start_scratch_4", tmp_path / "machine_c")   # an out dir's own is kept
    assert run_archive.weights_sha256(other) != run_archive.weights_sha256(kept)
    longer = sft_model(tmp_path / "machine_d" / "sft_start_scratch_4", steps=600)
    run_archive.keep_start(archive, longer, "sft_start_scratch_4")      # the design's SFT changed: replaced
    assert run_archive.weights_sha256(kept) == run_archive.weights_sha256(longer)
