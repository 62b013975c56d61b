"""The docs site serves its own mermaid: the diagrams render without network.

Material for MkDocs loads mermaid from a CDN unless a global `mermaid` is already defined; mkdocs.yml
loads the copy `make docs` fetches (pinned, checksummed) as an extra script. The build test runs
where MkDocs is installed (`make docs` installs it and runs this file after the build).
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MERMAID = "js/mermaid.min.js"


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):  # mkdocs.yml names Python objects (!!python/name:...): keep them as text
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_mkdocs_loads_mermaid_from_the_site():
    scripts = _mkdocs_config()["extra_javascript"]
    assert MERMAID in scripts and not any("://" in s for s in scripts)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^MERMAID_JS := docs/" + re.escape(MERMAID), makefile, re.M)  # what `make docs` fetches
    assert re.search(r"^MERMAID_SHA256 := [0-9a-f]{64}$", makefile, re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs built with `mkdocs build --strict` (skips without MkDocs or the fetched mermaid)."""
    pytest.importorskip("mkdocs", reason="MkDocs is the docs extra (`make docs` installs it)")
    if not (ROOT / "docs" / MERMAID).is_file():
        pytest.skip(f"docs/{MERMAID} is fetched by `make docs`")
    site = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return site


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_built_site_references_its_own_mermaid(site):
    assert (site / MERMAID).read_bytes()[:200] == (ROOT / "docs" / MERMAID).read_bytes()[:200]
    pages = [p for p in site.rglob("*.html") if 'class="mermaid"' in p.read_text()]
    assert pages, "no page with a mermaid diagram (README's step diagram lives in docs/index.md)"
    for page in pages:
        html = page.read_text()
        local = re.findall(r'<script src="([^"]*js/mermaid\.min\.js)"', html)
        assert local and not local[0].startswith(("http:", "https:", "//")), page
        assert (page.parent / local[0]).resolve() == (site / MERMAID).resolve(), page
        assert not re.search(r'<script src="(https?:)?//[^"]*mermaid', html), page


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diagram_renders_with_the_network_off(site):
    """Headless Chromium that resolves no host but 127.0.0.1 (the CDN unreachable) loads the home page
    from a local server: mermaid turned the diagram's source into a drawing (Material moves the SVG
    into a shadow root, so the DOM keeps an empty `div.mermaid` and no source text)."""
    chromium = next((shutil.which(n) for n in (os.environ.get("TLT_CHROMIUM"), "chromium", "chromium-browser",
                                                "google-chrome") if n and shutil.which(n)), None)
    if chromium is None:
        pytest.skip("no chromium binary on PATH (`make test-ui` installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=site,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=20000",
                              "--dump-dom", f"http://127.0.0.1:{port}/"], capture_output=True, text=True, timeout=300).stdout
    finally:
        server.terminate()
        server.wait(10)
    assert "tlt trains reasoning LLMs" in dom, dom[-2000:]  # the page itself loaded
    assert '<div class="mermaid">' in dom and "flowchart LR" not in dom, dom[-3000:]
