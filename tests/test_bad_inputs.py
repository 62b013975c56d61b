"""Bad inputs through the `tlt` CLI (a subprocess, as a user runs it): exit code 2, the problem in
one paragraph that names it and the fix, never a traceback. Data-file cases live in test_data.py.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cli_runs import ROOT, cli_env, prefect_api_url, run_tlt

BAD = ROOT / "tests" / "data" / "bad"

SMOKE = ["run", "conf/smoke.yaml"]


def _refused(proc, *words: str) -> str:
    out = proc.stdout
    assert proc.returncode == 2, f"rc {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out and "╭" not in out, out[-3000:]
    assert "attempt to run again" not in out, out[-3000:]  # a user error is not retried
    lines = out.strip().splitlines()
    # the CLI's own paragraph comes last, printed once (a data error lists its rows on the lines after it)
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, out[-3000:]
    last = "\n".join(lines[starts[0]:])
    for w in words:
        assert w in last, (w, last)
    return last


@pytest.fixture
def reward_module(tmp_path):
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "myreward.py").write_text(
        "def boom(completions, answers, **kw):\n    raise ZeroDivisionError('my bug')\n\n"
        "def nan(completions, answers, **kw):\n    return [float('nan')] * len(completions)\n")
    return tmp_path / "pp"


@pytest.mark.slow
@pytest.mark.parametrize("fn,words", [("boom", ["myreward:boom", "ZeroDivisionError", "my bug"]),
                                      ("nan", ["myreward:nan", "nan", "finite float"])])
def test_bad_reward_function(prefect_api, tmp_path, reward_module, fn, words):
    env = cli_env(tmp_path, prefect_api_url(), PYTHONPATH=str(reward_module))
    proc = run_tlt([*SMOKE, "--set", f"rl.reward=myreward:{fn}", "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}"],
                   env)
    _refused(proc, *words)


@pytest.mark.parametrize("yaml_text,sets,words", [
    ("rl:\n  stepz: 3\n", [], ["unknown key 'rl.stepz'", "did you mean 'rl.steps'"]),
    ("", ["rl.steps=three"], ["rl.steps", "three"]),
    ("", ["rollout.top_p=1.5"], ["rollout.top_p", "1.5"]),
    ("", ["drafter.buffer_steps=0"], ["drafter.buffer_steps"]),
    ("model: [1, 2]\n", [], ["model"]),
    ("", ["cluster.address=localhost"], ["cluster.address", "localhost", "ray://HOST:PORT"]),
    ("", ["drafter.spot=false"], ["drafter.spot", "drafter.where: sequential"]),
])
def test_bad_config(tmp_path, yaml_text, sets, words):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text or (ROOT / "conf" / "smoke.yaml").read_text())
    proc = run_tlt(["run", str(cfg), *sum((["--set", s] for s in sets), [])], cli_env(tmp_path), timeout=120)
    _refused(proc, *words)


@pytest.mark.slow
def test_export_into_non_empty_dir_refused_before_training(prefect_api, tmp_path):
    out = tmp_path / "served"
    out.mkdir()
    (out / "config.json").write_text("{}")  # e.g. the drafter a vLLM server is loading
    proc = run_tlt([*SMOKE, "--set", f"export.out_dir={out}", "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}"],
                   cli_env(tmp_path, prefect_api_url()))
    _refused(proc, str(out), "not empty")
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize("hidden,vocab,words", [(192, 512, ["hidden 128", "hidden 192"]),
                                                (128, 1024, ["vocab 1024", "vocab 512"])])
def test_drafter_for_another_target_refused(tmp_path, hidden, vocab, words):
    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.drafter.eagle3 import export_eagle3
    from tlt.models import tiny_model

    other = tiny_model("llama", layers=4, hidden=hidden, vocab=vocab, seed=0)
    export_eagle3(build_drafter(other, DrafterConfig(draft_vocab_size=64)), other.config, tmp_path / "drafter")
    proc = run_tlt(["bench", "rollout", "conf/smoke.yaml", "--drafter", str(tmp_path / "drafter")], cli_env(tmp_path),
                   timeout=120)
    _refused(proc, *words)


def _runs_in_store(tmp_path) -> int:
    db = tmp_path / "mlflow.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        return con.execute("SELECT count(*) FROM runs").fetchone()[0]


def _bad_args(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{case: (tlt args, words the error must hold)}: a wrong id or path for every command."""
    empty, full, ckpt_root = tmp / "empty", tmp / "full", tmp / "runs"
    empty.mkdir()
    full.mkdir()
    (full / "config.json").write_text("{}")
    (tmp / "blank.jsonl").write_text("")
    run = [*SMOKE, "--set", f"trainer.checkpoint_dir={ckpt_root}"]
    return {
        "run-resume": ([*run, "--resume", "deadbeef"], ["--resume 'deadbeef'", "tlt compare --experiment"]),
        "run-model-missing": ([*run, "--set", f"model.name_or_path={tmp / 'nope'}"], [str(tmp / "nope"), "not found"]),
        "run-model-empty": ([*run, "--set", f"model.name_or_path={empty}"], [str(empty), "config.json"]),
        "run-data-missing": ([*run, "--set", f"data.path={tmp / 'x.jsonl'}"], [str(tmp / "x.jsonl"), "not found"]),
        "run-data-empty": ([*run, "--set", f"data.path={tmp / 'blank.jsonl'}"], ["blank.jsonl", "empty"]),
        "run-export-target": ([*run, "--set", f"export.out_dir={full}"], [str(full), "not empty"]),
        "run-reward": ([*run, "--set", "rl.reward=nosuchmodule:fn"], ["nosuchmodule:fn", "importable"]),
        "export-run": (["export", "--run", "nosuchrun", "--out", str(tmp / "o")], ["--run 'nosuchrun'", "tlt compare"]),
        "export-checkpoint": (["export", "--checkpoint", str(tmp / "nock"), "--out", str(tmp / "o")],
                              ["--checkpoint", "nock", "step-NNNNNN"]),
        "export-out": (["export", "--checkpoint", str(empty), "--out", str(full)], ["--out", str(full), "--force"]),
        "export-no-checkpoint": (["export", "--checkpoint", str(empty), "--out", str(tmp / "o")],
                                 ["no complete checkpoint", str(empty)]),
        "export-what": (["export", "--checkpoint", str(empty), "--out", str(tmp / "o"), "--what", "weights"],
                        ["--what 'weights'", "policy, drafter or both"]),
        "export-register": (["export", "--checkpoint", str(empty), "--out", str(tmp / "o"), "--register"],
                            ["--register", "--run RUN_ID"]),
        "compare": (["compare", "nosuchrun"], ["'nosuchrun'", "tlt compare --experiment"]),
        "compare-out": (["compare", "--experiment", "tlt", "--out", str(tmp / "no" / "c.png")], ["no/c.png", "exist"]),
        "data-validate": (["data", "validate", str(tmp / "x.jsonl")], [str(tmp / "x.jsonl"), "not found"]),
        "warmstart-model": (["drafter", "warmstart", "conf/smoke.yaml", "--set", f"model.name_or_path={empty}"],
                            [str(empty), "config.json"]),
        "warmstart-export": (["drafter", "warmstart", "conf/smoke.yaml", "--export", str(full)], ["--export", "--force"]),
        "deploy": (["deploy", "conf/smoke.yaml", "--set", f"data.path={tmp / 'x.jsonl'}"], ["x.jsonl", "not found"]),
        "serve": (["serve", "conf/smoke.yaml", "--set", f"model.name_or_path={tmp / 'nope'}"], ["nope", "not found"]),
        "schedule": (["schedule", "conf/smoke.yaml", "--set", f"model.name_or_path={tmp / 'nope'}"],
                     ["nope", "not found"]),
        # the rows themselves, read before any service: malformed lines, row errors, a reward that raises
        "run-data-malformed": ([*run, "--set", f"data.path={BAD / 'malformed.jsonl'}"],
                               ["malformed.jsonl", "malformed line(s) (lines 2, 4, 5)"]),
        "run-data-rows": ([*run, "--set", f"data.path={BAD / 'duplicate_ids.jsonl'}"],
                          ["duplicate_ids.jsonl", "duplicate id 'a'", "data.on_invalid: drop"]),
        "config-check-data": (["config", "check", "conf/smoke.yaml", "--set", f"data.path={BAD / 'duplicate_ids.jsonl'}"],
                              ["duplicate_ids.jsonl", "duplicate id 'a'"]),
        "bench-rollout": (["bench", "rollout", "conf/smoke.yaml", "--drafter", str(empty)], ["--drafter", "config.json"]),
    }


CASES = ["run-resume", "run-model-missing", "run-model-empty", "run-data-missing", "run-data-empty",
         "run-export-target", "run-reward", "export-run", "export-checkpoint", "export-out", "export-no-checkpoint",
         "export-what", "export-register", "compare", "compare-out",
         "data-validate", "warmstart-model", "warmstart-export", "deploy", "serve", "schedule", "bench-rollout",
         "run-data-malformed", "run-data-rows", "config-check-data"]


@pytest.mark.parametrize("case", CASES)
def test_wrong_id_or_path_refused_before_anything_starts(tmp_path, case):
    """Exit 2 naming the value, no traceback, no MLflow run and no run folder: nothing started."""
    cases = _bad_args(tmp_path)
    assert sorted(cases) == sorted(CASES)
    args, words = cases[case]
    proc = run_tlt(args, cli_env(tmp_path), timeout=120)
    _refused(proc, *words)
    assert _runs_in_store(tmp_path) == 0
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "prefect").exists()  # no Prefect server or client started


def test_resume_of_a_finished_run_says_so_and_does_nothing(tmp_path):
    """`--resume` of a FINISHED run: exit 0 with one line saying so; no warm-start, evaluation, export or
    registry version: the store keeps its one run, unchanged, and nothing else starts."""
    from tlt.config import TrackingConfig, flatten, load_config
    from tlt.precision import resolve_run
    from tlt.tracking import make_tracker, read_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(TrackingConfig(tracking_uri=uri, system_metrics=False), run_name="smoke")
    tracker.log_params(flatten(resolve_run(load_config(ROOT / "conf" / "smoke.yaml"))[0]))
    tracker.log_metrics({"eval/accuracy": 0.25}, step=2)
    tracker.end("FINISHED")
    before = read_run(tracker.run_id, uri)
    exported = tmp_path / "export"  # the finished run's export: a full folder is no error here
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    proc = run_tlt([*SMOKE, "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}", "--set", f"export.out_dir={exported}",
                    "--resume", tracker.run_id[:8]], cli_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"run {tracker.run_id} has finished (held-out accuracy 0.250); there is nothing to resume" in proc.stdout
    assert "Traceback" not in proc.stdout
    after = read_run(tracker.run_id, uri)
    assert (after["metrics"], after["status"], after["models"]) == (before["metrics"], "FINISHED", {})
    assert _runs_in_store(tmp_path) == 1 and not (tmp_path / "runs").exists()
    assert not (tmp_path / "prefect").exists()  # no Prefect server or client started


def test_resume_with_other_settings_refused_before_anything_starts(tmp_path):
    """A run resumed with a changed config: exit 2 naming the key, both values and the run's own
    config.yaml; the store keeps its one run, unchanged."""
    from tlt.config import TrackingConfig, flatten, load_config
    from tlt.precision import resolve_run
    from tlt.tracking import make_tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(TrackingConfig(tracking_uri=uri, system_metrics=False), run_name="smoke")
    tracker.log_params(flatten(resolve_run(load_config(ROOT / "conf" / "smoke.yaml"))[0]))
    tracker.end("FAILED")  # a crashed run: what --resume is for (a finished one is reported as such)
    args = [*SMOKE, "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}", "--resume", tracker.run_id[:8]]
    proc = run_tlt([*args, "--set", "rl.steps=9"], cli_env(tmp_path), timeout=120)
    _refused(proc, tracker.run_id, "rl.steps: 2 -> 9", "config.yaml", "without --resume")
    assert _runs_in_store(tmp_path) == 1 and not (tmp_path / "runs").exists()
