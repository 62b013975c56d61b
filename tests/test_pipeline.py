"""The run's stages return what they made: an RL step its rollout samples and batch-level metrics,
an evaluation its records and (with a drafter) both held-out accept lengths, the export its model
folder with the accept lengths measured on it. Smoke recipe in this process, no tracker."""
from pathlib import Path

import pytest

from tlt.config import load_config
from tlt.pipeline import Pipeline, StageOrderError
from tlt.rollout.breakeven import rate_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe")
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp / 'runs'}", "rl.steps=1",
                                                      f"export.out_dir={tmp / 'export'}", "drafter.where=sequential"])
    with Pipeline(cfg) as p:
        p.validate_data()
        p.prepare()
        yield p


def test_evaluate_returns_records_and_accept_lengths(pipe):
    s = pipe.evaluate(0)
    assert len(s.records) == s.n == len(pipe.dataset.heldout)
    assert {"prompt", "answer", "response", "reward"} <= set(s.records[0])
    assert s.accept_len is not None and s.accept_len >= 1.0 and s.accept_len_sampled >= 1.0
    assert "records" not in s.model_dump()  # a tracked table, not part of the Prefect result
    assert not hasattr(pipe, "last_eval_records")


def test_a_stage_before_its_inputs_refuses(tmp_path):
    """Each stage's inputs are built by the stage before it; called out of order, a stage says which
    stage to run first instead of running on None (an RL step that would never train the drafter)."""
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path / 'runs'}"])
    with Pipeline(cfg) as p:
        with pytest.raises(StageOrderError, match=r"validate_data\(\)"):
            p.dataset
        with pytest.raises(StageOrderError, match=r"prepare\(\)"):
            p.evaluate(0)
        p.validate_data()
        p.prepare()
        with pytest.raises(StageOrderError, match=r"warm-started drafter.*warmstart\(\)"):
            p.resume()
        assert p.ctx is None and p.pool is None  # nothing started


def test_resume_then_rl_step_returns_samples_and_export_measures_the_folder(pipe):
    ws = pipe.warmstart()  # builds the drafter's refresher: the steps train the drafter (drafter.where sequential)
    # the bandit's prior is priced at the drafter's measured sampled acceptance (tlt.rollout.breakeven)
    assert ws.prior_accept_rate == pytest.approx(rate_of(ws.accept_len_sampled, pipe.cfg.drafter.eval_strategy.depth))
    cal = pipe.engine.calibration
    assert cal["prior_accept_rate"] == ws.prior_accept_rate and cal["tail_threshold"] == ws.tail_threshold
    assert pipe.engine.threshold() == pipe.cfg.rollout.spec_threshold == 8  # a configured number is kept
    assert pipe.resume() == 0  # builds the steps' parts itself
    assert pipe.ctx.refresher is not None
    s = pipe.rl_step(0)
    r = pipe.cfg.rollout
    assert len(s.samples) == r.prompts_per_step * r.group_size and {"reward", "response"} <= set(s.samples[0])
    assert pipe.ctx is not None and not hasattr(pipe.ctx, "samples")
    final = pipe.evaluate(1, accept=False)  # the flow's last evaluation when it exports
    assert final.accept_len is None
    ex = pipe.export(final)
    assert ex.accuracy == final.accuracy and ex.n == len(pipe.dataset.heldout)
    assert 1.0 <= ex.accept_len and 1.0 <= ex.accept_len_sampled  # measured on the exported folder
    assert (Path(ex.path) / "policy" / "config.json").is_file() and ex.serve.startswith(f"vllm serve {ex.path}/policy")
