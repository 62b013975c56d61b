"""The UIs in a real browser: a Prefect server with the tlt deployments registered (`tlt deploy`) and
an MLflow server holding a run logged by tlt's MlflowTracker, both on free 127.0.0.1 ports, rendered
by headless Chromium (the CLI: --dump-dom and --screenshot, no driver package). Both UIs are
single-page apps, so the names are looked for in the DOM after their scripts ran, not in the HTML.

Run with `make test-ui` (installs Debian's chromium when missing). Screenshots go to the test's tmp
folder and, when TLT_UI_SCREENSHOTS=DIR is set, are copied to DIR.
"""
from __future__ import annotations

import contextlib
import html.parser
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from _services import assert_stopped, live_pids, mlflow_server, prefect_server
from cli_runs import run_tlt


def _find_chromium() -> str | None:
    for name in (os.environ.get("TLT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM = _find_chromium()
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium, or "
                                                "`make test-ui`, which installs it; TLT_CHROMIUM=/path overrides)"),
]
# Virtual time (ms) the page may run before the DOM is dumped; raised on each try that lacks a name.
BUDGETS_MS = (10_000, 30_000, 60_000)
CHROMIUM_FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-extensions", "--hide-scrollbars", "--mute-audio"]

_LOG_RUN = """
import sys
from tlt.tracking import MlflowTracker
uri, name, spool = sys.argv[1:]
t = MlflowTracker("tlt", run_name=name, uri=uri, spool_dir=spool)
t.log_params({"model.name_or_path": "tiny:llama", "rl.steps": 3})
for step in range(3):
    t.log_metrics({"reward/mean": 0.25 * step, "spec/accept_len/mean": 1.0 + 0.2 * step}, step=step)
t.end()
print(t.client.get_run(t.run_id).info.experiment_id, t.run_id)
"""


class _Dom(html.parser.HTMLParser):
    """Text nodes (outside script/style) and links of a dumped DOM."""

    def __init__(self, markup: str):
        super().__init__()
        self.texts: set[str] = set()
        self.links: list[tuple[str, str]] = []
        self._skip = 0
        self._href: str | None = None
        self._link_text: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "noscript"):
            self._skip += 1
        elif tag == "a":
            self._href, self._link_text = dict(attrs).get("href") or "", []

    def handle_endtag(self, tag):
        if tag in ("script", "style", "noscript"):
            self._skip = max(0, self._skip - 1)
        elif tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._link_text).strip()))
            self._href = None

    def handle_data(self, data):
        if self._skip:
            return
        if data.strip():
            self.texts.add(data.strip())
        if self._href is not None:
            self._link_text.append(data)


def _render(url: str, png: Path, budget_ms: int, size: str, log: Path) -> str:
    """Load `url` in a fresh headless Chromium, let it run `budget_ms` of virtual time, save a
    screenshot to `png` and return the DOM. Chromium's process group is gone when this returns."""
    profile = tempfile.mkdtemp(prefix="tlt-chromium-")
    cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
           f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", "--dump-dom", url]
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic() + 10
    while (left := live_pids(lambda _pgid, cmd: profile in cmd)) and time.monotonic() < end:
        time.sleep(0.2)
    shutil.rmtree(profile, ignore_errors=True)
    assert not left, f"chromium processes left running: {left}"
    return out.decode(errors="replace")


def _rendered(url: str, name: str, tmp: Path, done, size: str = "1400,900") -> _Dom:
    """The DOM of `url` once `done(dom)` holds, raising the virtual-time budget between tries;
    the last screenshot is `tmp/<name>.png` (copied to $TLT_UI_SCREENSHOTS when set)."""
    png = tmp / f"{name}.png"
    for budget in BUDGETS_MS:
        markup = _render(url, png, budget, size, tmp / "chromium.log")
        (tmp / f"{name}.html").write_text(markup)
        dom = _Dom(markup)
        if done(dom):
            break
    if os.environ.get("TLT_UI_SCREENSHOTS") and png.exists():
        out = Path(os.environ["TLT_UI_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, out / png.name)
    assert png.exists() and png.stat().st_size > 0, f"no screenshot of {url}; see {tmp / 'chromium.log'}"
    return dom


@pytest.fixture(scope="module")
def uis(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    with contextlib.ExitStack() as stack:
        prefect = stack.enter_context(prefect_server(tmp))
        mlflow = stack.enter_context(mlflow_server(tmp))
        deploy = run_tlt(["deploy", "conf/smoke.yaml", "--set", f"trainer.checkpoint_dir={tmp / 'runs'}"],
                         prefect["env"], timeout=300, log=tmp / "deploy.log")
        assert deploy.returncode == 0, deploy.stdout[-3000:]
        ids = re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", deploy.stdout)
        assert len(ids) == 2, deploy.stdout[-3000:]
        run_name = f"ui-check-{os.getpid()}"
        env = {**prefect["env"], "MLFLOW_TRACKING_URI": mlflow["url"]}
        logged = subprocess.run([sys.executable, "-c", _LOG_RUN, mlflow["url"], run_name, str(tmp / "spool")],
                                check=False, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
        assert logged.returncode == 0, logged.stdout[-2000:] + logged.stderr[-3000:]
        exp_id, run_id = logged.stdout.split()[-2:]
        yield {"tmp": tmp, "prefect": prefect, "mlflow": mlflow, "run_name": run_name, "exp_id": exp_id,
               "run_id": run_id, "deployment_ids": dict(zip(["manual", "retrain"], ids))}
    # every server and its children are gone, their ports closed
    assert_stopped(prefect["proc"], prefect["port"])
    assert_stopped(mlflow["proc"], mlflow["port"])


def test_prefect_ui_lists_the_deployments(uis):
    url = f"{uis['prefect']['url']}/deployments"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "text/html"}), timeout=30) as r:
        shell = r.read().decode(errors="replace")
    assert "retrain" not in shell  # the names come from the app's API calls, not the served HTML
    ids = uis["deployment_ids"]

    def listed(dom):
        return {"manual", "retrain", "tlt-train"} <= dom.texts and all(
            any(href.endswith(dep_id) and text == name for href, text in dom.links) for name, dep_id in ids.items())

    dom = _rendered(url, "prefect-deployments", uis["tmp"], listed)
    assert {"manual", "retrain", "tlt-train"} <= dom.texts, sorted(dom.texts)[:200]
    for name, dep_id in ids.items():  # each name links to the deployment `tlt deploy` registered
        assert (f"/deployments/deployment/{dep_id}", name) in dom.links, (name, dom.links)


def test_mlflow_ui_shows_the_run(uis):
    url = f"{uis['mlflow']['url']}/#/experiments/{uis['exp_id']}/runs/{uis['run_id']}"
    metrics = {"reward/mean", "spec/accept_len/mean"}
    last_values = {"0.5", "1.4"}  # the values logged at the last step

    def shown(dom):
        return uis["run_name"] in dom.texts and metrics | last_values <= dom.texts

    dom = _rendered(url, "mlflow-run", uis["tmp"], shown, size="1400,1600")
    assert uis["run_name"] in dom.texts, sorted(dom.texts)[:200]
    assert metrics <= dom.texts, sorted(dom.texts)[:300]
    assert last_values <= dom.texts, sorted(dom.texts)[:300]
    assert uis["run_id"] in dom.texts
