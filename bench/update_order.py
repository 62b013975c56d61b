"""Policy update in rollout order vs length order (`trainer.group_by_length`), one run.

    python bench/update_order.py conf/longtail.yaml [--prompts 8] [--reps 2] [--json out.json] [--set k=v ...]

One plain rollout of `rollout.prompts_per_step` prompts x `rollout.group_size` samples (the
recipe's own lengths), then the same policy update (fused old log-probs, random advantages)
timed on that batch in both orders, interleaved A B A B from the same starting weights; prints
each order's padding share (`perf/update_padding_share`) and the time ratio. The two updates
give the same parameters up to fp32 summation order (tests/test_update.py).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from tlt.config import load_config
from tlt.data import load_dataset, prompt_ids
from tlt.models import eos_token_ids, load_target
from tlt.rl.logprobs import make_batch
from tlt.rl.step import padding_share, update_order
from tlt.rl.update import PolicyBatch, make_updater
from tlt.rollout import RolloutEngine


def rollout_batch(cfg, model, tok, n_prompts: int, seed: int):
    """Tensors (ids, attn, resp, pos) of one plain rollout of `n_prompts` training prompts."""
    rows = load_dataset(cfg.data, tok).train.sample(n=n_prompts, random_state=seed)
    prompts = [prompt_ids(tok, p, cfg.data.instruction, cfg.data.system_prompt) for p in rows["prompt"]]
    engine = RolloutEngine(model, cfg.rollout, eos_token_ids(tok, model), tok.pad_token_id)
    batch = engine.generate(prompts, group_size=cfg.rollout.group_size, spec=False, seed=seed)
    return make_batch(batch.prompt_ids, batch.response_ids, tok.pad_token_id), batch.response_ids


def timed_update(cfg, model, tensors, by_length: bool, seed: int) -> tuple[float, float]:
    """(seconds, padding share) of one policy update of a copy of `model` on the batch."""
    ids, attn, resp, pos = tensors
    idx = update_order(attn, torch.ones(len(ids), dtype=torch.bool), by_length)
    adv = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    pb = PolicyBatch(ids[idx], attn[idx], resp[idx], None, adv[idx], position_ids=pos[idx])
    updater = make_updater(copy.deepcopy(model), cfg)
    _, dt = harness.timed(lambda: updater.step(pb))
    updater.close()
    return dt, padding_share(attn[idx].sum(1), cfg.trainer.micro_batch_size)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None, help="default: rollout.prompts_per_step")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    model, tok = load_target(cfg.model)
    tensors, responses = rollout_batch(cfg, model, tok, args.prompts or cfg.rollout.prompts_per_step, args.seed)
    times: dict[str, list[float]] = {"rollout_order": [], "length_order": []}
    pad: dict[str, float] = {}
    for rep in range(args.reps):
        for name, by_length in (("rollout_order", False), ("length_order", True)):
            dt, pad[name] = timed_update(cfg, model, tensors, by_length, args.seed)
            times[name].append(dt)
            print(f"rep {rep} {name}: {dt:.1f} s (padding {pad[name]:.0%})", flush=True)
    best = {k: min(v) for k, v in times.items()}
    res = {"config": cfg.name, "rows": len(responses), "micro_batch_size": cfg.trainer.micro_batch_size,
           "response_lengths": sorted(map(len, responses)), "update_s": times, "padding_share": pad,
           "speedup": best["rollout_order"] / best["length_order"], "threads": torch.get_num_threads()}
    print(f"update: rollout order {best['rollout_order']:.1f} s (padding {pad['rollout_order']:.0%}) | "
          f"length order {best['length_order']:.1f} s (padding {pad['length_order']:.0%}) | x{res['speedup']:.2f}")
    return harness.write_result(res, "update_order", args, argv)


if __name__ == "__main__":
    main()
