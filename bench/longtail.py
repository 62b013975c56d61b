"""Long-tail check of a recipe: response lengths, accuracy and GRPO signal of the target's own rollouts.

    python bench/longtail.py conf/longtail.yaml [--prompts 16] [--group 4] [--json out.json] [--set k=v ...]

Draws `--prompts` rows of the config's held-out (or train) split, renders them as the pipeline
does (chat template + `data.instruction`), samples `--group` responses each with the plain engine
(no SD) at the recipe's `rollout.temperature` / `top_p` / `max_new_tokens`, and scores them with
`rl.reward`. Reports what decides whether the recipe suits TLT and GRPO:

- `response_length/{p50,p90,max,mean}` and `at_cap_share` (hit `max_new_tokens` without EOS):
  a long tail means `max_over_p50` >= 3, while few rows hit the cap;
- `accuracy` (mean reward) and `groups_with_variance` (share of prompts whose samples do not all
  score the same: the groups GRPO learns from).

Lengths count response tokens, the closing EOS included. No timings are asserted anywhere.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from tlt.config import load_config
from tlt.data import load_dataset, prompt_ids
from tlt.models import eos_token_ids, load_target
from tlt.rl.rewards import checked_rewards, get_reward_fn
from tlt.rollout import RolloutEngine


def length_stats(lengths: list[int], cap: int, finished_eos: list[bool]) -> dict[str, float]:
    """Percentiles of the response lengths and the share that stopped at the cap without EOS."""
    x = np.asarray(lengths, dtype=float)
    at_cap = [n >= cap and not eos for n, eos in zip(lengths, finished_eos, strict=True)]
    p50 = float(np.percentile(x, 50))
    return {"response_length/p50": p50, "response_length/p90": float(np.percentile(x, 90)),
            "response_length/max": float(x.max()), "response_length/mean": float(x.mean()),
            "at_cap_share": float(np.mean(at_cap)), "max_over_p50": float(x.max() / max(p50, 1.0))}


def reward_stats(rewards: list[float], group_index: list[int]) -> dict[str, float]:
    """Mean reward and the share of groups with reward variance (not every sample scored the same)."""
    r, g = np.asarray(rewards, dtype=float), np.asarray(group_index)
    groups = np.unique(g)
    varied = [np.ptp(r[g == k]) > 0 for k in groups]
    return {"accuracy": float(r.mean()), "groups_with_variance": float(np.mean(varied)), "groups": len(groups)}


def run(cfg, n_prompts: int = 16, group: int = 4, split: str = "heldout", seed: int = 0,
        model_and_tokenizer=None) -> dict:
    """Generate n_prompts x group plain rollouts of the recipe and return the JSON-able statistics."""
    model, tok = model_and_tokenizer or load_target(cfg.model)
    ds = load_dataset(cfg.data, tok)
    pool = ds.heldout if split == "heldout" else ds.train
    if len(pool) < n_prompts:
        raise SystemExit(f"--prompts {n_prompts}: the {split} split holds only {len(pool)} rows "
                         f"(raise data.heldout_size or use --split train)")
    rows = pool.sample(n=n_prompts, random_state=seed).sort_index()  # all generators, not the first one's rows
    prompts = [prompt_ids(tok, p, cfg.data.instruction, cfg.data.system_prompt) for p in rows["prompt"]]
    r = cfg.rollout
    engine = RolloutEngine(model, r, eos_token_ids(tok, model), tok.pad_token_id)
    batch = engine.generate(prompts, group_size=group, spec=False, seed=seed)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in batch.response_ids]
    pick = lambda col: [rows[col].iloc[i] for i in batch.group_index]  # noqa: E731
    rewards = checked_rewards(get_reward_fn(cfg.rl.reward), texts, pick("answer"), tasks=pick("task"),
                              metas=pick("meta"))
    lengths = [len(ids) for ids in batch.response_ids]
    result = {"config": cfg.name, "prompts": n_prompts, "group": group, "split": split,
              "tasks": sorted(set(rows["task"])), "instruction": cfg.data.instruction, "reward": cfg.rl.reward,
              "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
              "threads": torch.get_num_threads()}
    result.update(length_stats(lengths, r.max_new_tokens, batch.finished_eos))
    result.update(reward_stats(rewards, batch.group_index))
    result["lengths"] = lengths
    result["samples"] = [{"prompt": rows["prompt"].iloc[g], "answer": rows["answer"].iloc[g], "response": t,
                          "reward": w, "tokens": n}
                         for g, t, w, n in zip(batch.group_index, texts, rewards, lengths)]
    return result


def print_table(res: dict, show: int = 0) -> None:
    for s in res["samples"][:show]:
        print(f"--- [{s['reward']:.0f}] {s['tokens']} tok, gold {s['answer']}: {s['response']!r}")
    print(f"\n{res['config']}: {res['prompts']} prompts x {res['group']} samples, T={res['temperature']}, "
          f"top_p={res['top_p']}, cap {res['max_new_tokens']}, reward {res['reward']}, tasks {', '.join(res['tasks'])}")
    harness.print_table([res], {"response_length/p50": ("p50", ".0f"), "response_length/p90": ("p90", ".0f"),
                                "response_length/max": ("max", ".0f"), "response_length/mean": ("mean", ".1f"),
                                "max_over_p50": ("max/p50", ".2f"), "at_cap_share": ("at cap", ".2f"),
                                "accuracy": ("accuracy", ".3f"), "groups_with_variance": ("groups var", ".2f")})


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--split", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and of sampling")
    ap.add_argument("--show", type=int, default=0, help="print the first N responses")
    args = ap.parse_args(argv)
    res = run(load_config(args.config, args.overrides), args.prompts, args.group, args.split, args.seed)
    print_table(res, args.show)
    return harness.write_result(res, "longtail", args, argv)


if __name__ == "__main__":
    main()
