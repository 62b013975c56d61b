"""Rollout benchmark: the engine without SD, with SD, and HF `generate`, same prompts and seed; in the GRPO
section also the field's baselines (bench/baselines.py: SD always on, the best static draft length per tier).

    python bench/rollout.py conf/default.yaml --json out.json [--drafter DIR|warmstart] [--prompts task] [--set k=v ...]

`--drafter warmstart` warm-starts the config's drafter first (as `tlt drafter warmstart` does, through
its cache under .cache/drafters) and benchmarks that export, so the result reruns from a clone.
"""
import tempfile
from pathlib import Path

import torch

import harness
from tlt.corpus import vocab_coverage
from tlt.prompts import prompt_ids
from tlt.errors import UserError
from tlt.drafter.eagle3 import load_eagle3
from tlt.preflight import check_run_inputs
from tlt.metrics import rollout_metrics
from tlt.models import eos_token_ids, load_target
from tlt.precision import resolve_run
from tlt.rollout import RolloutEngine, StrategyTuner
from tlt.rollout.acceptance import heldout_accept

QUESTIONS = ["Explain step by step how to compute 23 * 17.", "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system and one fact about each.", "Explain what a prime number is, with examples.",
    "Describe how to make a cup of tea, step by step.", "What is 48 + 75? Show your reasoning.",
    "Summarize the water cycle in a few sentences.", "Write a Python function that reverses a string and explain it.",
    "Explain the difference between weather and climate.", "Give three tips for learning a new language.",
    "Count from 1 to 20, separated by commas.", "Explain how a binary search works.",
    "What are the primary colors? Explain how they mix.", "Describe the rules of tic-tac-toe.",
    "Compute 12 * 12 and 13 * 13, and explain the pattern.", "Explain why the sky is blue."]
baselines = harness.load("baselines")
FLAGS = (("--drafter", None, "EAGLE-3 export directory, or 'warmstart': the config's warm-started drafter "
                             "(default: n-gram drafter)"), ("--batches", "1,4,16", None),
         ("--max-new-tokens", None, None, int), ("--reps", 2, None), ("--no-grpo", False, None),
         ("--row-prompts", 16, "prompts per row: batch b runs row_prompts / b batches"),
         ("--tuner", False, "SD rows: the configured strategy tuner, not rollout.strategy"),
         ("--prompts", "generic", "generic chat questions, or the config's held-out prompts", ("generic", "task")))


def prompts_for(cfg, tok, kind: str, n: int, instruction: str = "") -> list[list[int]]:
    """n task prompts, or n chat-templated QUESTIONS (cycling, `instruction` appended)."""
    if kind == "task":
        return harness.heldout_prompts(cfg, tok, n)
    return [prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)], instruction) for i in range(n)]


def hf_tokens(model, prompts, pad_id, eos_ids, max_new) -> int:
    """Greedy HF generate over a left-padded batch: tokens generated (up to EOS)."""
    width = max(len(p) for p in prompts)
    out = model.generate(input_ids=torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]),
                         attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id)
    return sum(next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row)) for row in out[:, width:].tolist())


def batch_row(plain, spec, model, batches, pad_id, eos_ids, max_new, reps) -> tuple[dict, bool]:
    """Plain / SD interleaved (best of reps over all batches) and HF generate at one batch size, greedy."""
    kw = dict(max_new_tokens=max_new, temperature=0.0)
    best = harness.best_of({"plain": lambda: [plain.generate(b, spec=False, **kw) for b in batches],
                            "spec": lambda: [spec.generate(b, spec=True, **kw) for b in batches],
                            "hf": lambda: sum(hf_tokens(model, b, pad_id, eos_ids, max_new) for b in batches)}, reps)
    (t_plain, a), (t_spec, b), (t_hf, n_hf) = best["plain"], best["spec"], best["hf"]
    n_tok = sum(len(r) for x in a for r in x.response_ids)
    plain_s, spec_s, hf = n_tok / t_plain, n_tok / t_spec, n_hf / t_hf
    passes = max(sum(x.stats.spec_row_passes for x in b), 1)
    return {"batch": len(batches[0]), "prompts": sum(map(len, batches)), "plain_tok_s": plain_s, "spec_tok_s": spec_s,
            "hf_tok_s": hf, "speedup_vs_plain": spec_s / plain_s, "speedup_vs_hf": spec_s / hf,
            "plain_vs_hf": plain_s / hf, "accept_len_mean": sum(x.stats.spec_tokens for x in b) / passes}, \
        all(x.response_ids == y.response_ids for x, y in zip(a, b))


def accept_fields(cfg, model, tok, drafter, r, prompts: str) -> dict:
    """Honest accept length (tuner off, `drafter.eval_strategy`) greedy and at the rollout temperature
    on `drafter.warmstart_eval_prompts` prompts, and the draft vocabulary's coverage of the greedy tokens."""
    n, temp, eos = cfg.drafter.warmstart_eval_prompts, cfg.rollout.temperature or 1.0, eos_token_ids(tok, model)
    held = prompts_for(cfg, tok, prompts, n)
    eng = RolloutEngine(model, r, eos, tok.pad_token_id, drafter=drafter)
    point = RolloutEngine(model, r.model_copy(update={"sampled_drafts": False}), eos, tok.pad_token_id, drafter=drafter)
    greedy = heldout_accept(eng, held, cfg, 0.0)
    reduced = drafter is not None and drafter.draft_vocab_size < drafter.vocab_size
    return {"accept_len_greedy": greedy.accept_len,
            "accept_len_sampled": heldout_accept(eng, held, cfg, temp).accept_len,
            "accept_len_sampled_point_mass": heldout_accept(point, held, cfg, temp).accept_len,
            "vocab_coverage": vocab_coverage(drafter.t2d if reduced else None, greedy.responses),
            "accept_strategy": cfg.drafter.eval_strategy.name, "accept_prompts": n}


def run_bench(cfg, drafter_dir: str | None = None, batches=(1, 4, 16), max_new_tokens: int | None = None,
              reps: int = 2, grpo: bool = True, model_and_tokenizer=None, prompts: str = "generic",
              row_prompts: int = 16, tuner: bool = False) -> dict:
    """The benchmark for a RunConfig; returns the JSON-able result (see the module docstring). `tuner`:
    the configured bandit picks every SD round's strategy (default: the fixed `rollout.strategy`)."""
    model, tok = model_and_tokenizer or load_target(cfg.model)
    eos_ids, pad_id = eos_token_ids(tok, model), tok.pad_token_id
    drafter = load_eagle3(drafter_dir, model).eval() if drafter_dir else None
    r = cfg.rollout.model_copy(update={"drafter": "eagle" if drafter is not None else "ngram", "tuner": False})
    max_new = max_new_tokens or r.max_new_tokens
    rows, identical = [], True
    for bs in batches:
        n = max(bs, row_prompts // bs * bs)
        pool = prompts_for(cfg, tok, prompts, n)
        spec = RolloutEngine(model, r.model_copy(update={"spec_threshold": bs}), eos_ids, pad_id, drafter=drafter,
                             tuner=StrategyTuner.from_config(r) if tuner else None)
        row, same = batch_row(RolloutEngine(model, r, eos_ids, pad_id), spec, model,
                              [pool[i:i + bs] for i in range(0, n, bs)], pad_id, eos_ids, max_new, reps)
        rows.append(row)
        identical &= same
        keys = ("plain_tok_s", "spec_tok_s", "hf_tok_s", "speedup_vs_plain", "accept_len_mean")
        print(f"batch {bs:>3}: " + ", ".join(f"{k} {row[k]:.2f}" for k in keys), flush=True)
    result = {"drafter": drafter_dir or "ngram", "prompts": prompts, "max_new_tokens": max_new, "tuner": tuner,
              "threads": torch.get_num_threads(), "rollout_dtype": r.dtype, "greedy_identical": identical,
              "rows": rows, "strategy": r.strategy.model_dump(), **accept_fields(cfg, model, tok, drafter, r, prompts)}
    if grpo:
        result.update(grpo_arms(cfg, model, tok, drafter, prompts, reps, eos_ids, pad_id))
    return result


def grpo_arms(cfg, model, tok, drafter, prompts: str, reps: int, eos_ids, pad_id) -> dict:
    """prompts x group at temperature 1.0: plain, tail-switched SD (tuner as configured), SD always on with the
    fixed strategy, and the static table of a sweep (bench/baselines.py); keys `grpo` and rollout_s_*/speedup_vs_*."""
    g, group = cfg.rollout, prompts_for(cfg, tok, prompts, cfg.rollout.prompts_per_step, cfg.data.instruction)
    plain = RolloutEngine(model, g, eos_ids, pad_id)
    tuned = StrategyTuner.from_config(g) if g.tuner else None
    spec = RolloutEngine(model, g, eos_ids, pad_id, drafter=drafter, tuner=tuned)
    always = RolloutEngine(model, g.model_copy(update=baselines.config_update("always", cfg)), eos_ids, pad_id,
                           drafter=drafter)
    table = baselines.sweep(always, group, g.tuner_buckets, g.strategy.depth, temperature=1.0)
    static = RolloutEngine(model, g.model_copy(update=baselines.config_update("static", cfg)), eos_ids, pad_id,
                           drafter=drafter, tuner=baselines.static_tuner(table))
    kw = dict(group_size=g.group_size, temperature=1.0, seed=0)
    best = harness.best_of({"plain": lambda: plain.generate(group, spec=False, **kw),
                            "spec": lambda: spec.generate(group, spec=True, **kw),
                            "always": lambda: always.generate(group, spec=True, **kw),
                            "static": lambda: static.generate(group, spec=True, **kw)}, reps)
    secs = {arm: t for arm, (t, _) in best.items()}
    m = rollout_metrics(best["spec"][1])
    return {"grpo": {"plain_s": secs["plain"], "spec_s": secs["spec"], "speedup": secs["plain"] / secs["spec"],
                     "accept_len_mean": m.get("spec/accept_len/mean", 1.0), "tail_share": m["rollout/tail_share"],
                     "enabled_share": m["spec/enabled_share"],
                     **{f"response_length_{k}": m[f"rollout/response_length/{k}"] for k in ("max", "mean")}},
            "rollout_s_plain": secs["plain"], "rollout_s_spec": secs["spec"], "rollout_s_always": secs["always"],
            "rollout_s_static": secs["static"], "speedup_vs_always": secs["always"] / secs["spec"],
            "speedup_vs_static": secs["static"] / secs["spec"], "static_table": table}


def warmstarted_drafter(cfg, out: Path) -> str:
    """The config's drafter warm-started on its corpus (both cached under .cache/, so a rerun on the
    same config and seed gets the same drafter), exported as EAGLE-3 to `out`."""
    from tlt.drafter.eagle3 import export_eagle3
    from tlt.pipeline import Pipeline

    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"drafter": "eagle"}),
                                 "trainer": cfg.trainer.model_copy(update={"checkpoint_dir": str(out / "runs")})})
    with Pipeline(cfg) as pipe:
        pipe.validate_data()
        pipe.prepare()
        print(f"warm-start: {pipe.warmstart().model_dump_json()}", flush=True)
        export_eagle3(pipe.drafter, pipe.model.config, out / "drafter", force=True)
    return str(out / "drafter")


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, *FLAGS, threads=True), argv)
    cfg = harness.config(args)
    tmp = None
    if args.drafter == "warmstart":
        check_run_inputs(cfg)
        tmp = tempfile.TemporaryDirectory(prefix="tlt-bench-drafter-")
        args.drafter = warmstarted_drafter(cfg, Path(tmp.name))
    if args.drafter is not None and not (Path(args.drafter) / "config.json").is_file():
        raise UserError(f"--drafter '{args.drafter}' is not an EAGLE-3 export (no config.json there); pass the folder "
                        "`tlt export --out` or `tlt drafter warmstart --export` wrote")
    check_run_inputs(cfg)  # the config's paths, before any model loads (exit 2 from `tlt bench`)
    cfg = resolve_run(cfg)[0]  # 'auto' precisions as a run on this hardware resolves them: decode in that dtype
    res = run_bench(cfg, args.drafter, [int(b) for b in args.batches.split(",")], args.max_new_tokens, args.reps,
                    grpo=not args.no_grpo, prompts=args.prompts, row_prompts=args.row_prompts, tuner=args.tuner)
    if tmp is not None:
        res["drafter"] = "warmstart"
        tmp.cleanup()
    return harness.write_result(res, "rollout", args, argv)


if __name__ == "__main__":
    main()
