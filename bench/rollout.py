"""Rollout benchmark: the engine without SD, with SD, and HF `generate`, same prompts and seed.

    python bench/rollout.py conf/default.yaml --json out.json [--drafter DIR] [--set k=v ...]

Rows (greedy, batch 1 / 4 / 16): each row runs the same `--row-prompts` prompts (16) as batches of
its size; tokens/s of plain and SD engine runs interleaved A B A B batch by batch (best total of
`reps`, the machine is shared), and of HF generate; `greedy_identical` says whether every SD
output equals the plain one. SD is forced on at every row's batch size (threshold = batch) to
show where it stops paying -- that crossover is how `rollout.spec_threshold` is chosen. The GRPO
row runs prompts x group at temperature 1.0 with the configured tail switch and tuner.
Without `--drafter` (an EAGLE-3 export dir) SD uses the n-gram prompt-lookup drafter.
`--prompts task` takes every row's prompts from the config's held-out split (the tasks a
warm-started drafter was trained on) instead of the generic chat questions below.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from tlt.config import load_config
from tlt.metrics import rollout_metrics
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine, StrategyTuner

QUESTIONS = [
    "Explain step by step how to compute 23 * 17.", "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system and one fact about each.", "Explain what a prime number is, with examples.",
    "Describe how to make a cup of tea, step by step.", "What is 48 + 75? Show your reasoning.",
    "Summarize the water cycle in a few sentences.", "Write a Python function that reverses a string and explain it.",
    "Explain the difference between weather and climate.", "Give three tips for learning a new language.",
    "Count from 1 to 20, separated by commas.", "Explain how a binary search works.",
    "What are the primary colors? Explain how they mix.", "Describe the rules of tic-tac-toe.",
    "Compute 12 * 12 and 13 * 13, and explain the pattern.", "Explain why the sky is blue.",
]


def encode_prompts(tokenizer, n: int, suffix: str = "") -> list[list[int]]:
    """n chat-templated prompts (cycling over QUESTIONS)."""
    out = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)] + suffix
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def task_prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    """n held-out prompts of the config's dataset (cycling), rendered as the pipeline renders them."""
    from tlt.data import load_dataset, prompt_ids

    held = load_dataset(cfg.data, tokenizer).heldout["prompt"].tolist()
    return [prompt_ids(tokenizer, held[i % len(held)], cfg.data.instruction, cfg.data.system_prompt)
            for i in range(n)]


def hf_generate(model, prompts, pad_id, eos_ids, max_new, return_tokens: bool = False):
    """Greedy HF generate over a left-padded batch -> tokens generated (up to EOS) per second
    (and the token count with `return_tokens`)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out, dt = harness.timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                            do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id))
    n = 0
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        n += cut
    return (n / dt, n) if return_tokens else n / dt


def batch_row(eng_plain, eng_spec, model, batches, pad_id, eos_ids, max_new, reps):
    """Plain / SD interleaved batch by batch (best total of reps) and HF generate at one batch
    size, greedy, over `batches` (lists of prompts of that size, together `--row-prompts` prompts)."""
    best = {"plain": float("inf"), "spec": float("inf")}
    identical, n_tok, spec_tok, spec_pass = True, 0, 0, 0
    for _ in range(reps):
        t_plain = t_spec = 0.0
        n_tok = spec_tok = spec_pass = 0
        for prompts in batches:
            a, ta = harness.timed(lambda: eng_plain.generate(prompts, max_new_tokens=max_new, temperature=0.0, spec=False))
            b, tb = harness.timed(lambda: eng_spec.generate(prompts, max_new_tokens=max_new, temperature=0.0, spec=True))
            t_plain, t_spec = t_plain + ta, t_spec + tb
            n_tok += sum(len(r) for r in a.response_ids)
            identical &= a.response_ids == b.response_ids
            spec_tok += b.stats.spec_tokens
            spec_pass += b.stats.spec_row_passes
        best["plain"], best["spec"] = min(best["plain"], t_plain), min(best["spec"], t_spec)
    hf_tokens, hf_time = 0, 0.0
    for prompts in batches:
        rate, n = hf_generate(model, prompts, pad_id, eos_ids, max_new, return_tokens=True)
        hf_tokens, hf_time = hf_tokens + n, hf_time + n / rate
    plain, spec, hf = n_tok / best["plain"], n_tok / best["spec"], hf_tokens / hf_time
    return {"batch": len(batches[0]), "prompts": sum(len(p) for p in batches), "plain_tok_s": plain,
            "spec_tok_s": spec, "hf_tok_s": hf, "speedup_vs_plain": spec / plain, "speedup_vs_hf": spec / hf,
            "plain_vs_hf": plain / hf, "accept_len_mean": spec_tok / max(spec_pass, 1)}, identical


def grpo_row(cfg, model, drafter, prompts, eos_ids, pad_id, reps):
    """prompts x group at temperature 1.0: plain engine vs tail-switched SD (tuner as configured)."""
    r = cfg.rollout
    tuner = StrategyTuner.from_config(r) if r.tuner else None
    plain = RolloutEngine(model, r, eos_ids, pad_id)
    spec = RolloutEngine(model, r, eos_ids, pad_id, drafter=drafter, tuner=tuner)
    kw = dict(group_size=r.group_size, temperature=1.0, seed=0)
    best = harness.best_of({"plain": lambda: plain.generate(prompts, spec=False, **kw),
                            "spec": lambda: spec.generate(prompts, spec=True, **kw)}, reps)
    m = rollout_metrics(best["spec"][1])
    return {"plain_s": best["plain"][0], "spec_s": best["spec"][0], "speedup": best["plain"][0] / best["spec"][0],
            "accept_len_mean": m.get("spec/accept_len/mean", 1.0), "tail_share": m["rollout/tail_share"],
            "enabled_share": m["spec/enabled_share"], "response_length_max": m["rollout/response_length/max"],
            "response_length_mean": m["rollout/response_length/mean"]}


def accept_fields(cfg, model, tok, drafter, r, prompts: str) -> dict:
    """Honest accept length (tuner off, `drafter.eval_strategy`) greedy and at the rollout temperature
    on `drafter.warmstart_eval_prompts` prompts, and the draft vocabulary's coverage of the greedy tokens."""
    from tlt.corpus import vocab_coverage
    from tlt.rollout.engine import measure_accept

    d = cfg.drafter
    n = d.warmstart_eval_prompts
    held = task_prompts(cfg, tok, n) if prompts == "task" else encode_prompts(tok, n)
    eng = RolloutEngine(model, r, eos_token_ids(tok, model), tok.pad_token_id, drafter=drafter)
    greedy = measure_accept(eng, held, 0.0, d.eval_max_new_tokens, d.eval_strategy)
    sampled = measure_accept(eng, held, cfg.rollout.temperature or 1.0, d.eval_max_new_tokens, d.eval_strategy)
    point = RolloutEngine(model, r.model_copy(update={"sampled_drafts": False}), eos_token_ids(tok, model),
                          tok.pad_token_id, drafter=drafter)
    point_mass = measure_accept(point, held, cfg.rollout.temperature or 1.0, d.eval_max_new_tokens, d.eval_strategy)
    reduced = drafter is not None and drafter.draft_vocab_size < drafter.vocab_size
    return {"accept_len_greedy": greedy.accept_len, "accept_len_sampled": sampled.accept_len,
            "accept_len_sampled_point_mass": point_mass.accept_len,
            "vocab_coverage": vocab_coverage(drafter.t2d if reduced else None, greedy.responses),
            "accept_strategy": d.eval_strategy.name, "accept_prompts": n}


def run_bench(cfg, drafter_dir: str | None = None, batches=(1, 4, 16), max_new_tokens: int | None = None,
              reps: int = 2, grpo: bool = True, model_and_tokenizer=None, prompts: str = "generic",
              row_prompts: int = 16, tuner: bool = False) -> dict:
    """Run the benchmark for a RunConfig; returns the JSON-able result (see module docstring)."""
    model, tok = model_and_tokenizer or load_target(cfg.model)
    eos_ids, pad_id = eos_token_ids(tok, model), tok.pad_token_id
    drafter = None
    if drafter_dir:
        from tlt.export import load_eagle3
        drafter = load_eagle3(drafter_dir, model).eval()
    r = cfg.rollout.model_copy(update={"drafter": "eagle" if drafter is not None else "ngram", "tuner": False})
    max_new = max_new_tokens or r.max_new_tokens
    rows, identical = [], True
    plain_eng = RolloutEngine(model, r, eos_ids, pad_id)
    for bs in batches:
        n = max(bs, row_prompts // bs * bs)
        pool = task_prompts(cfg, tok, n) if prompts == "task" else encode_prompts(tok, n)
        # --tuner: the configured bandit (with its plain arm) picks every round's strategy and
        # keeps learning across reps; default: the fixed `rollout.strategy` every round.
        bandit = StrategyTuner.from_config(r) if tuner else None
        spec_eng = RolloutEngine(model, r.model_copy(update={"spec_threshold": bs}), eos_ids, pad_id, drafter=drafter,
                                 tuner=bandit)
        row, same = batch_row(plain_eng, spec_eng, model, [pool[i:i + bs] for i in range(0, n, bs)], pad_id,
                              eos_ids, max_new, reps)
        rows.append(row)
        identical &= same
        print(f"batch {bs:>3}: plain {row['plain_tok_s']:.1f} tok/s | SD {row['spec_tok_s']:.1f} tok/s "
              f"(x{row['speedup_vs_plain']:.2f}, accept {row['accept_len_mean']:.2f}) | HF {row['hf_tok_s']:.1f} tok/s",
              flush=True)
    result = {"drafter": drafter_dir or "ngram", "prompts": prompts, "max_new_tokens": max_new, "tuner": tuner,
              "threads": torch.get_num_threads(),
              "greedy_identical": identical, "rows": rows, "strategy": r.strategy.model_dump()}
    result.update(accept_fields(cfg, model, tok, drafter, r, prompts))
    print(f"accept length ({result['accept_strategy']}, tuner off, {result['accept_prompts']} prompts): "
          f"greedy {result['accept_len_greedy']:.2f}, T={cfg.rollout.temperature} {result['accept_len_sampled']:.2f} "
          f"(point-mass rule {result['accept_len_sampled_point_mass']:.2f}), "
          f"vocab coverage {result['vocab_coverage']:.3f}", flush=True)
    if grpo:
        n = cfg.rollout.prompts_per_step
        group = task_prompts(cfg, tok, n) if prompts == "task" else encode_prompts(tok, n, cfg.data.instruction)
        result["grpo"] = grpo_row(cfg, model, drafter, group, eos_ids, pad_id, reps)
    return result


def print_table(result: dict) -> None:
    print(f"\ndrafter={result['drafter']} prompts={result['prompts']} greedy_identical={result['greedy_identical']} "
          f"threads={result['threads']}")
    harness.print_table(result["rows"], {
        "batch": ("batch", "d"), "plain_tok_s": ("plain tok/s", ".1f"), "spec_tok_s": ("SD tok/s", ".1f"),
        "hf_tok_s": ("HF tok/s", ".1f"), "speedup_vs_plain": ("SD/plain", ".2f"), "speedup_vs_hf": ("SD/HF", ".2f"),
        "plain_vs_hf": ("plain/HF", ".2f"), "accept_len_mean": ("accept", ".2f")})
    if "grpo" in result:
        g = result["grpo"]
        print(f"GRPO batch: plain {g['plain_s']:.2f}s, SD {g['spec_s']:.2f}s (x{g['speedup']:.2f}), "
              f"accept {g['accept_len_mean']:.2f}, tail share {g['tail_share']:.2f}")


def check_inputs(cfg, drafter_dir: str | None) -> None:
    """The config's paths and the drafter folder, before any model loads (exit 2 from `tlt bench`)."""
    from tlt.errors import UserError
    from tlt.inputs import check_run_inputs

    if drafter_dir is not None and not (Path(drafter_dir) / "config.json").is_file():
        raise UserError(f"--drafter '{drafter_dir}' is not an EAGLE-3 export (no config.json there); pass the folder "
                        "`tlt export --out` or `tlt drafter warmstart --export` wrote")
    check_run_inputs(cfg)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--drafter", default=None, help="EAGLE-3 export directory (default: n-gram drafter)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--row-prompts", type=int, default=16,
                    help="prompts per row: batch b runs row_prompts / b batches of b (one prompt is too noisy)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-grpo", action="store_true")
    ap.add_argument("--tuner", action="store_true", help="SD rows: the configured strategy tuner (with its plain "
                    "arm) instead of the fixed rollout.strategy")
    ap.add_argument("--prompts", choices=("generic", "task"), default="generic",
                    help="generic chat questions, or the config's held-out task prompts (every row)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg, args.drafter)
    result = run_bench(cfg, args.drafter, [int(b) for b in args.batches.split(",")], args.max_new_tokens,
                       args.reps, grpo=not args.no_grpo, prompts=args.prompts, row_prompts=args.row_prompts,
                       tuner=args.tuner)
    print_table(result)
    return harness.write_result(result, "rollout", args, argv)


if __name__ == "__main__":
    main()
