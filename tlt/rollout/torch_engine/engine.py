"""Batched rollout engine: HF forward + slot KV cache, tail-switched speculative decoding.

One `generate` call: prefill each distinct prompt once (left padding, explicit positions, a 4D
boolean mask), replicate its cache `group_size` times, then decode. While more than
`cfg.spec_threshold` sequences run, each step is one plain decode step for the whole batch; in
the tail (<= threshold running, for more than `cfg.spec_patience` consecutive steps) each step is
a speculative round (draft, verify, accept; see spec.py) with the strategy chosen by the tuner per
batch-size bucket (TLT §mechanisms 1 and 3), which may also be a plain step (the no-SD arm).
Finished sequences leave the batch (their cache rows are dropped).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from tlt import arch
from tlt.config import RolloutConfig, SpecStrategy
from tlt.rollout.breakeven import DEFAULT_THRESHOLD
from tlt.rollout.torch_engine.cache import SlotCache
from tlt.rollout.torch_engine.calibrate import Calibrator
from tlt.rollout.contract import (Capabilities, TunerState, check_fixed_strategy, fixed_config, swapped,
                                      torch_capabilities)
from tlt.rollout.guard import SpecGuard, check_probe, probe_inputs, probe_logits
from tlt.rollout.torch_engine.ngram import NgramDrafter, PromptHistory
from tlt.rollout.torch_engine.sampling import sample, token_logprobs
from tlt.rollout.torch_engine.spec import RoundParts, spec_round
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.torch_engine.state import DecodeState, Outputs, block_mask, prefill_mask
from tlt.rollout.torch_engine.weights import RolloutCopy
from tlt.versions import Synced


class RolloutEngine(TunerState):
    """Generate responses with an HF causal LM; speculative in the tail when a drafter is available.

    drafter: an `Eagle3Drafter` (tlt.drafter.model) or None; None or `cfg.drafter == "ngram"`
    uses the model-free n-gram drafter for every round; otherwise rounds whose strategy has
    `source: ngram` do. tuner: a `StrategyTuner` or None (then `cfg.strategy` is used for every
    round). history: earlier responses per prompt (`PromptHistory`), searched by n-gram drafts
    when `cfg.group_drafts`; filled by every `generate` (evaluation included).
    """

    auto_cap = DEFAULT_THRESHOLD  # `spec_threshold: auto` only lowers the threshold here (tlt.rollout.breakeven)

    def __init__(self, model, cfg: RolloutConfig, eos_ids: list[int], pad_id: int, drafter=None, tuner=None):
        self.master, self.cfg, self.pad_id = model, cfg, pad_id
        self.copy = RolloutCopy.of(model, cfg.dtype)  # None: decode with the policy module itself
        self.model = model if self.copy is None else self.copy.module
        self.eos_ids = list(eos_ids)
        self.drafter_master = drafter if (drafter is not None and cfg.drafter == "eagle") else None
        # Drafting in the rollout dtype too: a frozen copy rounded from the drafter's fp32 master weights
        # (trained by the refresher or the spot trainer), refreshed at each rollout like the policy copy.
        self.drafter_copy = None if self.drafter_master is None else RolloutCopy.of(self.drafter_master, cfg.dtype)
        self.drafter = self.drafter_master if self.drafter_copy is None else self.drafter_copy.module
        if self.drafter_copy is not None:  # the copy embeds with the policy this engine decodes with, as its master
            # does: the embedding is the policy's (a buffer outside the drafter's state), so it follows the policy
            self.drafter.embed_weight = self.model.get_input_embeddings().weight.detach()
        self.ngram = NgramDrafter()
        self.history = PromptHistory(cfg.history_per_prompt if cfg.group_drafts else 0, cfg.history_prompts)
        self.tuner = tuner
        self.guard = SpecGuard.from_config(cfg)  # per-tier SD switch-off below break-even (tlt.rollout.guard)
        self._drafter_synced = Synced(drafter=self.drafter_master)  # its version, when drafting with it directly
        self.probe_metrics = self._probe_copy() if self.drafter_copy is not None else {}
        self.calibrator = Calibrator()  # drafter confidence -> acceptance, learned online (draft_stop_below)
        self.device = next(model.parameters()).device
        self.window = arch.sliding_window(model.config)[0]  # sliding-attention layers see this many positions
        self.eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self.forward_calls = 0  # target forwards, for tests (prefill once per group)

    # ---- target forward ------------------------------------------------------------------
    def forward(self, ids, pos, mask, cache, keep_last: bool = False, hidden: bool = False, capture=None):
        """ids/pos [B,Q], mask [B,1,Q,S+Q] bool -> (logits [B,Q|1,V] float, fused drafter hidden [B,Q,Hd] | None).

        capture: a `Capture` that records the raw target features (aux layers, final hidden) of these positions.
        """
        self.forward_calls += 1
        if self.window is not None:  # the slots are no positions: the window is applied to the key positions
            mask = arch.layer_masks(self.model.config, mask, pos, key_positions(cache, pos))
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True,
                         logits_to_keep=1 if keep_last else 0, output_hidden_states=hidden or capture is not None)
        out.logits = out.logits.float()  # sampling and acceptance in fp32 whatever the rollout dtype
        fused = None
        if hidden:
            aux = self.drafter.gather_aux(out.hidden_states, self.drafter.aux_layer_ids)
            fused = self.drafter.fuse(aux)
        if capture is not None:
            capture.last_hs = out.hidden_states
        return out.logits, fused

    # ---- public API ----------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, capture: list[int] | None = None,
                 spec_threshold: int | None = None, on_tail: Callable[[int], None] | None = None) -> RolloutBatch:
        """Sample `group_size` responses per prompt.

        capture: target hidden-state ids (HF `hidden_states` indices, e.g. a drafter's aux ids):
        the batch then carries `features`, per sequence (aux [T,len*H], final hidden [T,H]) over
        prompt + response, recorded by the decode forwards themselves (no second forward; the
        last response token, never fed, gets zeros). Plain decoding only (spec must be off).
        spec_threshold: this call's tail threshold instead of `cfg.spec_threshold` (e.g. the batch
        size: speculate on every step). on_tail: called once, with the number of running rows, when
        the rollout enters its tail (the spot trainer starts drafter training there, TLT mechanism 2).

        Returns a `RolloutBatch` with len(prompts) * group_size sequences, group-major
        (sequence i belongs to prompt i // group_size). `logprobs` are the policy log-probs of
        the sampled tokens at temperature 1 over the raw logits (no temperature, no top-p),
        as the RL loss needs them, whatever temperature was used for sampling.
        """
        cfg = self.cfg
        if self.copy is not None:
            self.copy.refresh(self.master)
        self._sync_drafter()
        opts = dict(max_new=max_new_tokens or cfg.max_new_tokens,
                    temperature=cfg.temperature if temperature is None else temperature,
                    top_p=cfg.top_p if top_p is None else top_p)
        use_spec = cfg.spec if spec is None else spec
        threshold = self.threshold(spec_threshold)
        calls0 = self.forward_calls
        if capture is not None and use_spec:
            raise ValueError("generate(capture=...) records plain decoding only: pass spec=False")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        t0 = time.perf_counter()
        outs = Outputs.empty(len(prompts) * group_size, opts["max_new"], self.device)
        outs.group_size = group_size
        if capture is not None:
            outs.capture = Capture(list(capture))
        st = self._prefill(prompts, group_size, opts, gen, outs, keep_aux=use_spec and self.drafter is not None)
        self._retire(st, outs)
        self._decode(st, opts, gen, outs, use_spec, threshold, on_tail)
        outs.stats.time_s = time.perf_counter() - t0
        if self.cfg.guard_patience and use_spec:
            outs.stats.guard_tripped = self.guard.observe(outs.steps)
        outs.stats.target_forwards = self.forward_calls - calls0
        batch = outs.to_batch(prompts, group_size)
        for p, r in zip(batch.prompt_ids, batch.response_ids):
            self.history.add(p, r)
        if outs.capture is not None:
            batch.features = outs.capture.sequences(prompts, group_size, batch.response_ids)
        return batch

    def _sync_drafter(self) -> None:
        """New drafter weights (its version moved: a refresh, a spot-trainer load, a checkpoint): rounded
        into the rollout-dtype copy, which must then pass the guard's probe, and the spec guard re-armed."""
        if self.drafter_master is None:
            return
        if self.drafter_copy is not None:
            changed = self.drafter_copy.refresh(self.drafter_master)
            if changed:
                self.probe_metrics = self._probe_copy()
        else:
            changed = bool(self._drafter_synced.moved(drafter=self.drafter_master))
            self._drafter_synced.take(drafter=self.drafter_master)
        if changed:
            self.guard.rearm()

    def _probe_copy(self) -> dict[str, float]:
        """The drafter copy computes its master's logits on the guard's probe (tlt.rollout.guard), within
        the copy dtype's tolerance, or DrafterMismatch."""
        probe = probe_inputs(self.drafter_master)
        dtype = str(self.drafter_copy.dtype).removeprefix("torch.")
        return check_probe(probe_logits(self.drafter_master, probe), probe_logits(self.drafter, probe), dtype,
                           "the torch engine's drafter copy")

    def sync(self, model=None) -> dict[str, float]:
        """Nothing to send when this engine decodes with the policy module itself (see tlt.rl.step);
        a rollout copy in another dtype (`rollout.dtype`) is rounded from the master weights."""
        if self.copy is None:
            return {}
        return {"rollout/weights_copied": float(self.copy.refresh(model if model is not None else self.master))}

    def sleep(self) -> dict[str, float]:
        """Nothing to hand to the update: this engine decodes with the policy's own memory."""
        return {}

    # ---- the rest of the Engine contract ---------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Every strategy (trees, n-gram arms), per-call SD, the tail switch; the tuner if given one."""
        return torch_capabilities(self.cfg, self.tuner is not None)

    def close(self) -> None:
        """Nothing to stop: the engine lives in this process and holds only tensors."""

    @contextmanager
    def fixed_strategy(self, strategy: SpecStrategy, batch_size: int = 8) -> Iterator[None]:
        """Within the block, every `generate` of up to `batch_size` prompts speculates with `strategy` on
        every step: tuner off, no spec guard, no patience, no confidence pruning, and a fresh, empty
        prompt history (n-gram strategies see no earlier answers, which are not kept). Config, tuner
        and history are back afterwards. Raises EngineCapabilityError for the plain arm."""
        check_fixed_strategy(self.capabilities, strategy)
        fresh = PromptHistory(self.history.per_prompt, self.history.max_prompts)
        with swapped(self, cfg=fixed_config(self.cfg, strategy, batch_size), tuner=None, history=fresh):
            yield

    # ---- steps ---------------------------------------------------------------------------
    def _decode(self, st: DecodeState, opts, gen, outs, use_spec: bool, threshold: int, on_tail) -> None:
        """Decode until every row finished: plain steps, SD rounds once <= threshold rows ran for
        more than `spec_patience` steps; `on_tail(n_running)` once when the tail starts."""
        in_tail, below = False, 0
        guard = self.guard if self.cfg.guard_patience else None  # 0: off (also measure_accept's fixed chain)
        while st.size > 0:
            n_run = st.size
            below = below + 1 if n_run <= threshold else 0
            if not in_tail and n_run <= threshold:
                in_tail = True
                if on_tail is not None:
                    on_tail(n_run)
            t_step = time.perf_counter()
            if use_spec and below > self.cfg.spec_patience and (guard is None or guard.allows(n_run)):
                self._spec_step(st, opts, gen, outs)
            else:
                self._plain_step(st, opts, gen, outs)
                outs.steps.plain(time.perf_counter() - t_step)
            if n_run <= threshold:
                outs.stats.tail_time_s += time.perf_counter() - t_step
            self._retire(st, outs)

    def _prefill(self, prompts, group_size, opts, gen, outs, keep_aux: bool) -> DecodeState:
        """Prefill each prompt once, replicate the cache per group member, sample the first tokens."""
        t0 = time.perf_counter()
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid = torch.arange(width, device=self.device) >= (width - lens).unsqueeze(1)  # [U, L]
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)
        n_layers = self.model.config.num_hidden_layers
        cache = SlotCache(n_layers, reserve=width + opts["max_new"] + 72)
        logits, fused = self.forward(ids, pos, prefill_mask(valid), cache, keep_last=True, hidden=keep_aux,
                                     capture=outs.capture)
        if outs.capture is not None:
            outs.capture.add_prompts(valid, len(prompts) * group_size, opts["max_new"])
        cache.valid = valid
        if group_size > 1:
            cache.repeat_rows(group_size)
        rep = lambda t: t.repeat_interleave(group_size, dim=0)  # noqa: E731
        logits = rep(logits[:, -1])
        tok = sample(logits, opts["temperature"], opts["top_p"], gen)
        st = DecodeState(rows=torch.arange(len(prompts) * group_size, device=self.device), cache=cache,
                         pos=rep(lens), last=tok, n_out=torch.zeros_like(tok),
                         prompts=[p for p in prompts for _ in range(group_size)])
        if keep_aux:
            # Drafter inputs for positions 0..L-1: (fused aux_t, token_{t+1}); the last uses the sampled token.
            st.add_pending(torch.cat([rep(ids[:, 1:]), tok[:, None]], 1), rep(fused), rep(pos), rep(valid))
        outs.emit(st, tok[:, None], token_logprobs(logits, tok)[:, None], torch.ones_like(tok), self.eos)
        outs.passes[st.rows] += 1
        outs.stats.prefill_s += time.perf_counter() - t0
        return st

    def _plain_step(self, st: DecodeState, opts, gen, outs) -> None:
        """One decode step for every running row: feed `last`, sample the next token."""
        ids, pos = st.last[:, None], st.pos[:, None]
        ones = torch.ones(st.size, 1, dtype=torch.bool, device=self.device)
        mask = block_mask(st.cache.valid, ones[:, :, None])
        logits, fused = self.forward(ids, pos, mask, st.cache, hidden=st.pending is not None, capture=outs.capture)
        if outs.capture is not None:  # features of `last`, response token n_out - 1 of each row
            outs.capture.add_step(st.rows, st.n_out - 1)
        logits = logits[:, -1]
        tok = sample(logits, opts["temperature"], opts["top_p"], gen)
        st.cache.valid = torch.cat([st.cache.valid, ones], 1)
        if st.pending is not None:
            st.add_pending(tok[:, None], fused, pos, ones)
        st.pos = st.pos + 1
        st.last = tok
        outs.emit(st, tok[:, None], token_logprobs(logits, tok)[:, None], ones[:, 0].long(), self.eos)
        outs.passes[st.rows] += 1
        outs.stats.decode_steps += 1

    def _spec_step(self, st: DecodeState, opts, gen, outs) -> None:
        """One speculative round with the tuner's (or the configured) strategy."""
        bsz = st.size
        strategy = self.tuner.choose(bsz) if self.tuner is not None else self.cfg.strategy
        t0 = time.perf_counter()
        if strategy.plain:  # the tuner's no-SD arm: one plain step, timed like a round
            self._plain_step(st, opts, gen, outs)
            produced = bsz
            outs.stats.tuner_plain_steps += 1
        else:
            produced = spec_round(self.round_parts(), st, strategy, opts, gen, outs)
        dt = time.perf_counter() - t0
        if strategy.plain:
            outs.steps.plain(dt)
        else:
            outs.steps.spec(self.guard.tier_of(bsz), dt, bsz, produced)
        if self.tuner is not None:
            self.tuner.update(bsz, strategy, produced / max(dt, 1e-9), seconds=dt)
            outs.stats.record_strategy(self.tuner.bucket_of(bsz), self.tuner.arm_index(bsz, strategy))
            outs.stats.regret = self.tuner.regret_stats()  # cumulative: the value after this call's last round

    def round_parts(self) -> RoundParts:
        """What a speculative round reads of this engine (tlt.rollout.torch_engine.spec.RoundParts)."""
        c = self.cfg
        return RoundParts(forward=self.forward, drafter=self.drafter, ngram=self.ngram, history=self.history,
                          calibrator=self.calibrator, eos=self.eos, group_drafts=c.group_drafts,
                          draft_min_prob=c.draft_min_prob, draft_stop_below=c.draft_stop_below,
                          sampled_drafts=c.sampled_drafts)

    def _retire(self, st: DecodeState, outs) -> None:
        """Drop finished rows from the batch (cache rows too) and compact the cache when sparse."""
        done = outs.done[st.rows]
        if bool(done.any()):
            st.select(torch.nonzero(~done).squeeze(1))
            if st.size:
                st.cache.compact()


def key_positions(cache: SlotCache, pos: torch.Tensor) -> torch.Tensor:
    """[B, S+Q] RoPE position of every key slot of a forward: the cache's valid slots hold positions
    0, 1, ... in slot order (left padding and rejected drafts are invalid), then the new queries' `pos`."""
    if cache.valid is None:
        return pos
    return torch.cat([cache.valid.long().cumsum(1) - 1, pos], dim=1)


class Capture:
    """Raw target features recorded during plain decoding (see `RolloutEngine.generate(capture=)`)."""

    def __init__(self, ids: list[int]):
        self.ids, self.last_hs = ids, None
        self.prompt: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.aux = self.fin = None

    def _take(self) -> tuple[torch.Tensor, torch.Tensor]:
        hs, self.last_hs = self.last_hs, None
        return torch.cat([hs[i] for i in self.ids], -1).float(), hs[-1].float()

    def add_prompts(self, valid: torch.Tensor, n_seq: int, max_new: int) -> None:
        aux, fin = self._take()
        self.prompt = [(aux[u, valid[u]].cpu(), fin[u, valid[u]].cpu()) for u in range(aux.shape[0])]
        self.aux = torch.zeros(n_seq, max_new, aux.shape[-1])
        self.fin = torch.zeros(n_seq, max_new, fin.shape[-1])

    def add_step(self, rows: torch.Tensor, idx: torch.Tensor) -> None:
        aux, fin = self._take()
        r, c = rows.cpu(), idx.cpu()
        self.aux[r, c] = aux[:, -1].cpu()
        self.fin[r, c] = fin[:, -1].cpu()

    def sequences(self, prompts, group_size: int, responses) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for i, resp in enumerate(responses):
            pa, pf = self.prompt[i // group_size]
            n = len(resp)
            out.append((torch.cat([pa, self.aux[i, :n]]), torch.cat([pf, self.fin[i, :n]])))
        return out
