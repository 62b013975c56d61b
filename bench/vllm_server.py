"""vLLM's OpenAI-compatible server on a tlt model folder, as a user deploys it: started with the
folder README's command (the CPU build's module form, `python -m vllm.entrypoints.openai.api_server`:
the CPU wheel's `vllm` script does not start) on 127.0.0.1 and a free port, in a process group of
its own; queried with the `openai` client (vLLM's dependency, so the queries run under the vLLM
interpreter); speculation counted from its /metrics. Used by bench/served.py and
tests/test_vllm_serve.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

CLIENT = """
import json, sys
from openai import OpenAI
base, model, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
out = []
for p in prompts:  # one request at a time: no batching effects on greedy ties
    r = client.completions.create(model=model, prompt=p, max_tokens=n, temperature=0.0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    out.append({"token_ids": (c.model_extra or {}).get("token_ids"), "finish_reason": c.finish_reason})
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(folder: Path) -> tuple[list[str], dict]:
    """(arguments after the interpreter, the speculative config) of the folder README's CPU-build
    command, as the user copies it."""
    readme = (Path(folder) / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("python -m vllm.entrypoints.openai.api_server"))
    spec = re.search(r"--speculative-config '(.*)'$", line).group(1)
    return (["-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(folder) / "policy"),
             "--speculative-config", spec], json.loads(spec))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server + engine core), SIGKILL what is left after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def serving(folder: Path, extra: list[str], log_path: Path, timeout_s: float = 600):
    """The server on `folder` (+ `extra` arguments) until the block ends, also when it fails; yields
    {"base": URL, "model": the policy path}. RuntimeError with the log's tail when it exits or is not
    healthy within `timeout_s`."""
    port = free_port()
    args, _ = serve_args(folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(VLLM_PY), *args, "--host", "127.0.0.1", "--port", str(port), *extra],
                                cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout_s
            while not _healthy(base):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not healthy in {timeout_s:.0f} s"
                    raise RuntimeError(f"vLLM server {why}:\n{log_path.read_text()[-4000:]}")
                time.sleep(2)
            yield {"base": base, "model": str(Path(folder) / "policy")}
        finally:
            stop(proc)


def _healthy(base: str) -> bool:
    try:
        return urllib.request.urlopen(f"{base}/health", timeout=5).status == 200
    except OSError:
        return False


def query(server: dict, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy completions of token-id prompts, one request at a time: [{"token_ids", "finish_reason"}]."""
    proc = subprocess.run([str(VLLM_PY), "-c", CLIENT, f"{server['base']}/v1", server["model"], json.dumps(prompts),
                           str(max_tokens)], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def spec_counters(server: dict) -> tuple[float, float]:
    """(drafts, accepted draft tokens) the server counted so far."""
    text = urllib.request.urlopen(f"{server['base']}/metrics", timeout=30).read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:spec_decode_num_drafts"), total("vllm:spec_decode_num_accepted_tokens")
