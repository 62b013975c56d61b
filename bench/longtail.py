"""Long-tail check of a recipe: response lengths, accuracy and GRPO signal of the target's own rollouts.

    python bench/longtail.py conf/longtail.yaml [--prompts 16] [--group 4] [--json out.json] [--set k=v ...]
    python bench/longtail.py conf/longtail.yaml --split train --prompts 8 --group 4 --update-reps 2
"""
import copy

import numpy as np
import torch

import harness
from tlt.build import encoder
from tlt.prompts import load_dataset
from tlt.models import eos_token_ids, load_target
from tlt.rl.logprobs import make_batch
from tlt.rl.rewards import checked_rewards, get_reward_fn
from tlt.rl.step import padding_share, update_order
from tlt.rl.update import PolicyBatch, make_updater
from tlt.rollout import RolloutEngine

FLAGS = (("--prompts", 16, None), ("--group", 4, None), ("--split", "heldout", None, ("heldout", "train")),
         ("--seed", 0, "seed of the prompt draw and of sampling"), ("--show", 0, "print the first N responses"),
         ("--update-reps", 0, "also time the policy update in rollout vs length order, N times each (0 = skip)"))


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
    varied = [np.ptp(r[g == k]) > 0 for k in np.unique(g)]
    return {"accuracy": float(r.mean()), "groups_with_variance": float(np.mean(varied)), "groups": len(varied)}


def update_orders(cfg, model, tok, batch, reps: int, seed: int) -> dict:
    """One policy update of a copy of `model` on `batch` (random advantages) in rollout order and in
    length order, interleaved `reps` times: seconds and padding share."""
    ids, attn, resp, pos = make_batch(batch.prompt_ids, batch.response_ids, tok.pad_token_id)
    adv = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    times, pad = {"rollout_order": [], "length_order": []}, {}
    for rep in range(reps):
        for name, by_length in (("rollout_order", False), ("length_order", True)):
            idx = update_order(attn, torch.ones(len(ids), dtype=torch.bool), by_length)
            updater = make_updater(copy.deepcopy(model), cfg)
            _, dt = harness.timed(lambda: updater.step(PolicyBatch(ids[idx], attn[idx], resp[idx], None, adv[idx],
                                                                   position_ids=pos[idx])))
            updater.close()
            times[name].append(dt)
            pad[name] = padding_share(attn[idx].sum(1), cfg.trainer.micro_batch_size)
            print(f"rep {rep} {name}: {dt:.1f} s (padding {pad[name]:.0%})", flush=True)
    return {"rows": len(batch.response_ids), "micro_batch_size": cfg.trainer.micro_batch_size,
            "response_lengths": sorted(map(len, batch.response_ids)), "update_s": times, "padding_share": pad,
            "speedup": min(times["rollout_order"]) / min(times["length_order"])}


def main(argv: list[str] | None = None) -> dict:
    """--prompts x --group plain rollouts of the recipe -> the JSON-able statistics."""
    args = harness.parse(harness.parser(__doc__, *FLAGS), argv)
    cfg, n, seed = harness.config(args), args.prompts, args.seed
    model, tok = load_target(cfg.model)
    pool = getattr(load_dataset(cfg.data, tok), args.split)  # the heldout or train rows
    if len(pool) < n:
        raise SystemExit(f"--prompts {n}: the {args.split} split holds only {len(pool)} rows "
                         f"(raise data.heldout_size or use --split train)")
    rows = pool.sample(n=n, random_state=seed).sort_index()  # all generators, not the first one's rows
    r = cfg.rollout
    batch = RolloutEngine(model, r, eos_token_ids(tok, model), tok.pad_token_id).generate(
        encoder(tok, cfg)(rows["prompt"]), group_size=args.group, spec=False, seed=seed)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in batch.response_ids]
    col = {c: [rows[c].iloc[i] for i in batch.group_index] for c in ("prompt", "answer", "task", "meta")}
    rewards = checked_rewards(get_reward_fn(cfg.rl.reward), texts, col["answer"], tasks=col["task"], metas=col["meta"])
    lengths = [len(ids) for ids in batch.response_ids]
    res = {"config": cfg.name, "prompts": n, "group": args.group, "split": args.split,
           "tasks": sorted(set(rows["task"])), "instruction": cfg.data.instruction, "reward": cfg.rl.reward,
           "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
           "threads": torch.get_num_threads(), **length_stats(lengths, r.max_new_tokens, batch.finished_eos),
           **reward_stats(rewards, batch.group_index), "lengths": lengths,
           "samples": [{"prompt": p, "answer": a, "response": t, "reward": w, "tokens": k}
                       for p, a, t, w, k in zip(col["prompt"], col["answer"], texts, rewards, lengths)],
           **(update_orders(cfg, model, tok, batch, args.update_reps, seed) if args.update_reps else {})}
    for s in res["samples"][:args.show]:
        print(f"--- [{s['reward']:.0f}] {s['tokens']} tok, gold {s['answer']}: {s['response']!r}")
    return harness.write_result(res, "longtail", args, argv)


if __name__ == "__main__":
    main()
