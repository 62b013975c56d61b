"""Bad inputs through the `tlt` CLI (a subprocess, as a user runs it): exit code 2, the problem in
one paragraph that names it and the fix, never a traceback. Data-file cases live in test_data.py.
"""
from __future__ import annotations

import pytest

from cli_runs import ROOT, cli_env, prefect_api_url, run_tlt

SMOKE = ["run", "conf/smoke.yaml"]


def _refused(proc, *words: str) -> str:
    out = proc.stdout
    assert proc.returncode == 2, f"rc {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out and "╭" not in out, out[-3000:]
    assert "attempt to run again" not in out, out[-3000:]  # a user error is not retried
    last = out.strip().splitlines()[-1]  # the CLI's own paragraph comes last
    assert last.startswith("error: "), last
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
    from tlt.export import export_eagle3
    from tlt.models import tiny_model

    other = tiny_model("llama", layers=4, hidden=hidden, vocab=vocab, seed=0)
    export_eagle3(build_drafter(other, DrafterConfig(draft_vocab_size=64)), other.config, tmp_path / "drafter")
    proc = run_tlt(["bench", "rollout", "conf/smoke.yaml", "--drafter", str(tmp_path / "drafter")], cli_env(tmp_path),
                   timeout=120)
    _refused(proc, *words)
