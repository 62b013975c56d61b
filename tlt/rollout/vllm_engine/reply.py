"""The vLLM worker's reply to a `generate` request, turned into tlt's `RolloutBatch` and its stats
(tlt/rollout/vllm_engine/backend.py sends the request; tlt/rollout/vllm_engine/vllm_worker.py answers it)."""
from __future__ import annotations

from tlt.rollout.batch import RolloutBatch
from tlt.rollout.stats import RolloutStats


def reply_batch(prompts, group_size: int, reply: dict, wall_s: float, depth: int) -> RolloutBatch:
    """A vLLM worker's `generate` reply -> RolloutBatch; the worker's counters become the `RolloutStats`
    that metrics read. depth: the draft length K the call was scheduled with (0: no SD)."""
    seqs, k = reply["seqs"], depth
    drafted, accepted, passes, spec_tokens = [], [], [], 0
    pos = [0] * k
    for s in seqs:
        c = s["spec"] or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_pos": []}
        # Each verify step emits accepted + 1 tokens; vLLM also counts drafts accepted past the end.
        spec_tok = min(c["accepted"] + c["drafts"], max(len(s["ids"]) - 1, 0))
        drafted.append(c["draft_tokens"])
        accepted.append(c["accepted"])
        passes.append(len(s["ids"]) - spec_tok + c["drafts"])  # prefill + plain steps + verify steps
        spec_tokens += spec_tok
        pos = [a + b for a, b in zip(pos, c["accepted_pos"] + [0] * (k - len(c["accepted_pos"])))]
    rounds = sum((s["spec"] or {}).get("drafts", 0) for s in seqs)
    stats = RolloutStats(time_s=wall_s, tail_time_s=reply["tail_time_s"], decode_steps=reply["steps"],
                         spec_steps=reply.get("sd_steps", reply["steps"]) if rounds else 0, spec_row_passes=rounds,
                         spec_tokens=spec_tokens, accepted_pos=pos if rounds else [],
                         drafted_pos=(reply.get("drafted_pos") or [rounds] * k)[:k] if rounds else [],
                         tokens=sum(len(s["ids"]) for s in seqs),
                         vllm={**reply["counters"], "time_s": reply["time_s"]} | (
                             {"trace": reply["trace"]} if reply.get("trace") is not None else {}))
    return RolloutBatch(prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
                        response_ids=[s["ids"] for s in seqs], logprobs=[s["logprobs"] for s in seqs],
                        group_index=[i // group_size for i in range(len(seqs))],
                        finished_eos=[s["finish"] == "stop" for s in seqs], drafted=drafted, accepted=accepted,
                        target_passes=passes, stats=stats)
