"""`tlt drafter warmstart CONFIG --export DIR`: real data, model and drafter training; the export
is a valid EAGLE-3 directory for the same target; a non-empty export dir is refused (exit 2)."""
import json

import pytest

from cli_runs import ROOT, cli_env, run_tlt
from tlt.config import load_config
from tlt.drafter.eagle3 import check_export
from tlt.models import load_target


@pytest.mark.slow
def test_warmstart_cli_exports_a_loadable_drafter(tmp_path):
    out = tmp_path / "drafter"
    args = ["drafter", "warmstart", "conf/smoke.yaml", "--export", str(out),
            "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}"]
    r = run_tlt(args, cli_env(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:]
    summary = json.loads(r.stdout[r.stdout.index("{"): r.stdout.rindex("}") + 1])
    assert summary["accept_len_after"] >= 1.0 and summary["train_steps"] >= 1
    cfg = load_config(ROOT / "conf/smoke.yaml")
    target, _ = load_target(cfg.model)
    assert check_export(out, target.config) == []

    again = run_tlt(args, cli_env(tmp_path))
    assert again.returncode == 2, again.stdout[-2000:]
    assert "not empty" in again.stdout and "Traceback" not in again.stdout
