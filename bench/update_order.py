"""Policy update in rollout order vs length order (`trainer.group_by_length`), one run.

    python bench/update_order.py conf/longtail.yaml [--prompts 8] [--reps 2] [--json out.json] [--set k=v ...]

One plain rollout of `--prompts` training prompts x `rollout.group_size` samples, then the same
policy update (fused old log-probs, random advantages) timed on it in both orders, interleaved from
the same starting weights: each order's padding share and the time ratio. Both give the same
parameters up to fp32 summation order (tests/test_update.py).
"""
from __future__ import annotations

import copy

import torch

import harness
from tlt.data import load_dataset
from tlt.models import eos_token_ids, load_target
from tlt.rl.logprobs import make_batch
from tlt.rl.step import padding_share, update_order
from tlt.rl.update import PolicyBatch, make_updater
from tlt.rollout import RolloutEngine


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


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None, help="default: rollout.prompts_per_step")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = harness.parse(ap, argv)
    cfg = harness.config(args)
    model, tok = load_target(cfg.model)
    rows = load_dataset(cfg.data, tok).train.sample(n=args.prompts or cfg.rollout.prompts_per_step,
                                                    random_state=args.seed)
    batch = RolloutEngine(model, cfg.rollout, eos_token_ids(tok, model), tok.pad_token_id).generate(
        harness.encode(cfg, tok, rows["prompt"]), group_size=cfg.rollout.group_size, spec=False, seed=args.seed)
    tensors = make_batch(batch.prompt_ids, batch.response_ids, tok.pad_token_id)
    times: dict[str, list[float]] = {"rollout_order": [], "length_order": []}
    pad: dict[str, float] = {}
    for rep in range(args.reps):
        for name, by_length in (("rollout_order", False), ("length_order", True)):
            dt, pad[name] = timed_update(cfg, model, tensors, by_length, args.seed)
            times[name].append(dt)
            print(f"rep {rep} {name}: {dt:.1f} s (padding {pad[name]:.0%})", flush=True)
    res = {"config": cfg.name, "rows": len(batch.response_ids), "micro_batch_size": cfg.trainer.micro_batch_size,
           "response_lengths": sorted(map(len, batch.response_ids)), "update_s": times, "padding_share": pad,
           "speedup": min(times["rollout_order"]) / min(times["length_order"]), "threads": torch.get_num_threads()}
    print(f"update: length order x{res['speedup']:.2f} faster than rollout order")
    return harness.write_result(res, "update_order", args, argv)


if __name__ == "__main__":
    main()
