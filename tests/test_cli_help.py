"""The command line's own text: `--version`, help that shows what to type, `tlt schedule` and its old name."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tlt.provenance import tlt_version

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tlt.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_version_names_the_release_and_the_commit():
    r = _cli("--version")
    assert r.returncode == 0 and re.fullmatch(rf"tlt {re.escape(tlt_version())}( \(git [0-9a-f]{{12}}(, modified)?\))?\n",
                                              r.stdout), r.stdout


@pytest.mark.parametrize("command", [["--help"], ["run", "--help"], ["config", "check", "--help"],
                                     ["compare", "--help"], ["data", "validate", "--help"], ["ui", "--help"],
                                     ["schedule", "--help"], ["config", "reference", "--help"], ["export", "--help"],
                                     ["drafter", "warmstart", "--help"], ["tracking", "sync", "--help"],
                                     ["deploy", "--help"]])
def test_help_shows_metavars_not_python_types(command):
    r = _cli(*command)
    assert r.returncode == 0, r.stderr
    for typer_type in ("<bool>", "<str>", "<int>", "<path>", "list[str]", "{", "╭"):
        assert typer_type not in r.stdout, (typer_type, r.stdout)


def test_run_help_names_what_to_type():
    text = _cli("run", "--help").stdout
    assert "run [OPTIONS] CONFIG" in text and "--set KEY=VALUE" in text and "--resume RUN_ID" in text


def test_serve_is_a_hidden_alias_of_schedule_that_warns(tmp_path):
    top = _cli("--help").stdout
    assert re.search(r"^\s+schedule\s", top, re.M) and not re.search(r"^\s+serve\s", top, re.M)
    r = _cli("serve", "conf/smoke.yaml", "--set", f"model.name_or_path={tmp_path / 'nope'}")
    assert "`tlt serve` is now `tlt schedule`" in r.stderr
    assert r.returncode == 2 and "not found" in r.stderr  # then it checks and refuses exactly as schedule does


def test_config_reference_write_needs_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# no markers\n")
    r = _cli("config", "reference", "--write", str(page))
    assert r.returncode == 2 and "config-reference:start" in r.stderr and "docs/configuration.md" in r.stderr
    page.write_text("intro\n<!-- config-reference:start -->\nSTALE TABLE\n<!-- config-reference:end -->\ntail\n")
    assert _cli("config", "reference", "--write", str(page)).returncode == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("tail\n") and "### `drafter`" in text and "STALE TABLE" not in text


def test_source_tags_name_the_commit_and_version():
    from tlt.provenance import source_tags

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    tags = source_tags("tlt-train")
    assert tags["mlflow.source.git.commit"] == head and tags["tlt.git.dirty"] in ("true", "false")
    assert tags["mlflow.source.name"] == "tlt-train" and tags["tlt.version"] == tlt_version()
