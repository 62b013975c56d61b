"""The UIs in a real browser, as a user meets them: a Prefect server and an MLflow server on free
127.0.0.1 ports; `tlt run conf/smoke.yaml` trains against both, then `tlt schedule conf/smoke.yaml`
serves the deployments. Headless Chromium (the CLI: --dump-dom and --screenshot, no driver
package) renders the run `tlt run` made (the page it links to, in MLflow's model-training view,
with its logged model; its metric charts; a plot of its artifacts) and the served deployment's
page (*Ready*). Both UIs are single-page apps, so names are looked for in the DOM after their
scripts ran, not in the HTML.

Run with `make test-ui` (installs Debian's chromium when missing). Screenshots go to the test's tmp
folder and, when TLT_UI_SCREENSHOTS=DIR is set, are copied to DIR.
"""
from __future__ import annotations

import contextlib
import html.parser
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _services import assert_stopped, live_pids, mlflow_server, prefect_server
from cli_runs import TLT, ROOT, run_tlt


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
# --run-all-compositor-stages-before-draw: without it, charts that wait for their layout (MLflow's
# metric charts) never draw within virtual time.
CHROMIUM_FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
                  "--run-all-compositor-stages-before-draw"]

class _Dom(html.parser.HTMLParser):
    """Text nodes (outside script/style; as a set and in document order), links and images
    ((alt, src)) of a dumped DOM."""

    def __init__(self, markup: str):
        super().__init__()
        self.texts: set[str] = set()
        self.order: list[str] = []
        self.links: list[tuple[str, str]] = []
        self.images: list[tuple[str, str]] = []
        self._skip = 0
        self._href: str | None = None
        self._link_text: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "noscript"):
            self._skip += 1
        elif tag == "a":
            self._href, self._link_text = dict(attrs).get("href") or "", []
        elif tag == "img":
            self.images.append((dict(attrs).get("alt") or "", dict(attrs).get("src") or ""))

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
            self.order.append(data.strip())
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


def _deployments(api: str) -> dict[str, dict]:
    """{name: deployment} from the Prefect API."""
    req = urllib.request.Request(f"{api}/deployments/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return {d["name"]: d for d in json.load(r)}


@contextlib.contextmanager
def _served(args: list[str], env: dict[str, str], api: str, log: Path, timeout: float = 300) -> Iterator[dict]:
    """`tlt ARGS` (`tlt schedule ...`) in its own process group until both deployments are READY (the
    runner polls the API); yields them by name. On exit the group is stopped, then checked gone."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([TLT, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline, found = time.monotonic() + timeout, {}
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                found = _deployments(api)
            if all(found.get(n, {}).get("status") == "READY" for n in ("manual", "retrain")):
                break
            time.sleep(2)
        assert proc.poll() is None, f"tlt schedule exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert all(found.get(n, {}).get("status") == "READY" for n in ("manual", "retrain")), (
            {n: d.get("status") for n, d in found.items()}, log.read_text()[-3000:])
        yield found
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic() + 15
    while (left := live_pids(lambda pgid, _cmd: pgid == proc.pid)) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, f"tlt schedule left processes running: {left}"


@pytest.fixture(scope="module")
def uis(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    with contextlib.ExitStack() as stack:
        prefect = stack.enter_context(prefect_server(tmp))
        mlflow = stack.enter_context(mlflow_server(tmp))
        env = {**prefect["env"], "MLFLOW_TRACKING_URI": mlflow["url"], "TLT_MLFLOW_SPOOL_DIR": str(tmp / "spool"),
               "PYTHONUNBUFFERED": "1"}
        overrides = ["--set", f"trainer.checkpoint_dir={tmp / 'runs'}"]
        trained = run_tlt(["run", "conf/smoke.yaml", *overrides], env, timeout=900, log=tmp / "run.log")
        assert trained.returncode == 0, trained.stdout[-3000:]
        # the link `tlt run` prints: the run's page on this server, in the model-training view
        link = re.search(r"open (http://\S+/#/experiments/(\d+)/runs/([0-9a-f]{32})\?workflowType=machine_learning)",
                         trained.stdout)
        assert link and link.group(1).startswith(mlflow["url"]), trained.stdout[-2000:]
        served = stack.enter_context(_served(["schedule", "conf/smoke.yaml", *overrides], env, prefect["api"],
                                             tmp / "serve.log"))
        yield {"tmp": tmp, "prefect": prefect, "mlflow": mlflow, "run_link": link.group(1), "exp_id": link.group(2),
               "run_id": link.group(3), "deployment_ids": {name: served[name]["id"] for name in ("manual", "retrain")}}
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
    for name, dep_id in ids.items():  # each name links to the deployment `tlt schedule` registered
        assert (f"/deployments/deployment/{dep_id}", name) in dom.links, (name, dom.links)


def _after(dom: _Dom, label: str) -> str | None:
    """The text that follows `label` in document order (a field's value on a details page)."""
    return next((dom.order[i + 1] for i, t in enumerate(dom.order[:-1]) if t == label), None)


def test_prefect_ui_shows_the_served_deployment_ready(uis):
    dep_id = uis["deployment_ids"]["manual"]
    url = f"{uis['prefect']['url']}/deployments/deployment/{dep_id}"

    def ready(dom):
        return "manual" in dom.texts and _after(dom, "Status") == "Ready"

    dom = _rendered(url, "prefect-deployment", uis["tmp"], ready)
    assert "manual" in dom.texts and "tlt-train" in dom.texts, sorted(dom.texts)[:200]
    assert _after(dom, "Status") == "Ready", dom.order[:300]
    assert dep_id in dom.texts


def test_mlflow_ui_opens_the_run_in_the_training_view(uis):
    """The page `tlt run` links to: the run, its logged model and registered version, its datasets,
    in the model-training view (its side bar: Runs, Models, Model registry; no GenAI sections)."""
    wanted = {"smoke", uis["run_id"], "model", "tlt-model", "Model registry"}

    def shown(dom):
        return wanted <= dom.texts and any(t.startswith("Logged models") for t in dom.texts)

    dom = _rendered(uis["run_link"], "mlflow-run", uis["tmp"], shown, size="1400,3000")
    assert wanted <= dom.texts, sorted(wanted - dom.texts)
    assert any(t.startswith("train-prompts (") for t in dom.texts), sorted(dom.texts)[:300]  # name (digest)
    assert "Logged models (1)" in " ".join(dom.order), dom.order[:400]
    assert not {"Evaluation runs", "Judges", "Prompts"} & dom.texts, "the GenAI view opened"
    model = [href for href, _ in dom.links if f"/experiments/{uis['exp_id']}/models/m-" in href]
    assert model, dom.links  # a link to the logged model's page


def test_mlflow_ui_draws_the_metric_charts(uis):
    base = uis["run_link"].split("?")[0]
    # one chart per metric, each named by its series: "<run name> (<metric>)"
    series = {f"smoke ({key})" for key in ("reward/mean", "spec/accept_len/mean", "eval/accuracy", "policy/loss")}

    def drawn(dom):
        return series <= dom.texts

    dom = _rendered(f"{base}/model-metrics?workflowType=machine_learning", "mlflow-charts", uis["tmp"], drawn,
                    size="1400,16000")  # tall: sections below the fold are not drawn
    assert series <= dom.texts, sorted(series - dom.texts)
    markup = (uis["tmp"] / "mlflow-charts.html").read_text()
    assert markup.count('class="main-svg"') >= 2 * len(series)  # plotly drew them (two svg layers a chart)


def test_mlflow_ui_shows_a_plot_artifact(uis):
    base = uis["run_link"].split("?")[0]
    plot = "plots/accept_len.png"

    def shown(dom):
        return any(alt == plot and src.startswith("blob:") for alt, src in dom.images)

    dom = _rendered(f"{base}/artifacts/{plot}?workflowType=machine_learning", "mlflow-plot", uis["tmp"], shown)
    assert any(alt == plot and src.startswith("blob:") for alt, src in dom.images), dom.images
    assert {"plots", "accept_len.png", "reward_accuracy.png"} <= dom.texts, sorted(dom.texts)[:300]
