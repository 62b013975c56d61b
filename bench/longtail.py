"""Long-tail check of a recipe: response lengths, accuracy and GRPO signal of the target's own rollouts.

    python bench/longtail.py conf/longtail.yaml [--prompts 16] [--group 4] [--json out.json] [--set k=v ...]
    python bench/longtail.py conf/longtail.yaml --split train --prompts 8 --group 4 --update-reps 2

`--prompts` rows of the held-out (or train) split, rendered as the pipeline does, `--group` plain
samples each at the recipe's temperature, top_p and max_new_tokens, scored with `rl.reward`. A long
tail means `max_over_p50` >= 3 while few rows hit the cap (`at_cap_share`); `groups_with_variance`
is the share of prompts whose samples do not all score the same (the groups GRPO learns from).
Lengths count response tokens, the closing EOS included. `--update-reps N` also times one policy
update (fused old log-probs, random advantages) on these rollouts in rollout order and in length
order (`trainer.group_by_length`), interleaved from the same weights, N times each: `update_s`,
`padding_share` and `speedup` (rollout order / length order, best of N).
"""
from __future__ import annotations

import copy

import numpy as np
import torch

import harness
from tlt.data import load_dataset
from tlt.models import eos_token_ids, load_target
from tlt.rl.logprobs import make_batch
from tlt.rl.rewards import checked_rewards, get_reward_fn
from tlt.rl.step import padding_share, update_order
from tlt.rl.update import PolicyBatch, make_updater
from tlt.rollout import RolloutEngine


def length_stats(lengths: list[int], cap: int, finished_eos: list[bool]) -> dict[str, float]:
    """Percentiles of the response lengths and the share that stopped at the cap without EOS."""
    x = np.asarray(lengths, dtype=float)
    p50 = float(np.percentile(x, 50))
    return {"response_length/p50": p50, "response_length/p90": float(np.percentile(x, 90)),
            "response_length/max": float(x.max()), "response_length/mean": float(x.mean()),
            "at_cap_share": float(np.mean([n >= cap and not e for n, e in zip(lengths, finished_eos, strict=True)])),
            "max_over_p50": float(x.max() / max(p50, 1.0))}


def reward_stats(rewards: list[float], group_index: list[int]) -> dict[str, float]:
    """Mean reward and the share of groups with reward variance (not every sample scored the same)."""
    r, g = np.asarray(rewards, dtype=float), np.asarray(group_index)
    groups = np.unique(g)
    varied = [np.ptp(r[g == k]) > 0 for k in groups]
    return {"accuracy": float(r.mean()), "groups_with_variance": float(np.mean(varied)), "groups": len(groups)}


def timed_update(cfg, model, tensors, by_length: bool, seed: int) -> tuple[float, float]:
    """(seconds, padding share) of one policy update of a copy of `model` on the batch."""
    ids, attn, resp, pos = tensors
    idx = update_order(attn, torch.ones(len(ids), dtype=torch.bool), by_length)
    adv = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    updater = make_updater(copy.deepcopy(model), cfg)
    _, dt = harness.timed(lambda: updater.step(PolicyBatch(ids[idx], attn[idx], resp[idx], None, adv[idx],
                                                           position_ids=pos[idx])))
    updater.close()
    return dt, padding_share(attn[idx].sum(1), cfg.trainer.micro_batch_size)


def update_orders(cfg, model, tok, batch, reps: int, seed: int) -> dict:
    """The policy update on `batch` in rollout order and in length order, interleaved `reps` times."""
    tensors = make_batch(batch.prompt_ids, batch.response_ids, tok.pad_token_id)
    times: dict[str, list[float]] = {"rollout_order": [], "length_order": []}
    pad: dict[str, float] = {}
    for rep in range(reps):
        for name, by_length in (("rollout_order", False), ("length_order", True)):
            dt, pad[name] = timed_update(cfg, model, tensors, by_length, seed)
            times[name].append(dt)
            print(f"rep {rep} {name}: {dt:.1f} s (padding {pad[name]:.0%})", flush=True)
    return {"rows": len(batch.response_ids), "micro_batch_size": cfg.trainer.micro_batch_size,
            "response_lengths": sorted(map(len, batch.response_ids)), "update_s": times, "padding_share": pad,
            "speedup": min(times["rollout_order"]) / min(times["length_order"])}


def run(cfg, n_prompts: int = 16, group: int = 4, split: str = "heldout", seed: int = 0, update_reps: int = 0) -> dict:
    """n_prompts x group plain rollouts of the recipe -> the JSON-able statistics."""
    model, tok = load_target(cfg.model)
    ds = load_dataset(cfg.data, tok)
    pool = ds.heldout if split == "heldout" else ds.train
    if len(pool) < n_prompts:
        raise SystemExit(f"--prompts {n_prompts}: the {split} split holds only {len(pool)} rows "
                         f"(raise data.heldout_size or use --split train)")
    rows = pool.sample(n=n_prompts, random_state=seed).sort_index()  # all generators, not the first one's rows
    r = cfg.rollout
    batch = RolloutEngine(model, r, eos_token_ids(tok, model), tok.pad_token_id).generate(
        harness.encode(cfg, tok, rows["prompt"]), group_size=group, spec=False, seed=seed)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in batch.response_ids]
    col = {c: [rows[c].iloc[i] for i in batch.group_index] for c in ("prompt", "answer", "task", "meta")}
    rewards = checked_rewards(get_reward_fn(cfg.rl.reward), texts, col["answer"], tasks=col["task"], metas=col["meta"])
    lengths = [len(ids) for ids in batch.response_ids]
    return {"config": cfg.name, "prompts": n_prompts, "group": group, "split": split,
            "tasks": sorted(set(rows["task"])), "instruction": cfg.data.instruction, "reward": cfg.rl.reward,
            "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
            "threads": torch.get_num_threads(), **length_stats(lengths, r.max_new_tokens, batch.finished_eos),
            **reward_stats(rewards, batch.group_index), "lengths": lengths,
            "samples": [{"prompt": p, "answer": a, "response": t, "reward": w, "tokens": n}
                        for p, a, t, w, n in zip(col["prompt"], col["answer"], texts, rewards, lengths)],
            **(update_orders(cfg, model, tok, batch, update_reps, seed) if update_reps else {})}


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--split", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and of sampling")
    ap.add_argument("--show", type=int, default=0, help="print the first N responses")
    ap.add_argument("--update-reps", type=int, default=0, help="also time the policy update in rollout vs length "
                    "order on these rollouts, N times each (0 = skip)")
    args = harness.parse(ap, argv)
    res = run(harness.config(args), args.prompts, args.group, args.split, args.seed, args.update_reps)
    for s in res["samples"][:args.show]:
        print(f"--- [{s['reward']:.0f}] {s['tokens']} tok, gold {s['answer']}: {s['response']!r}")
    harness.print_keys(res, ("config", "tasks", "response_length/p50", "response_length/p90", "response_length/max",
                             "max_over_p50", "at_cap_share", "accuracy", "groups_with_variance", "padding_share",
                             "speedup"))
    return harness.write_result(res, "longtail", args, argv)


if __name__ == "__main__":
    main()
