"""The adaptive drafter under policy drift: frozen vs adaptive vs control on one policy trajectory.

    python bench/adaptive.py conf/default.yaml --json out.json [--steps 5] [--rl-lr 1e-4]
        [--drafter-steps 4] [--eval-prompts 64] [--eval-tokens 48] [--oracle-steps 32] [--set k=v ...]

One Pipeline run (SD off in its rollouts: SD is lossless, so the policy does not depend on the
drafter) with a raised `rl.lr` so the policy really drifts. Its own refresher is the *adaptive*
arm: `drafter.refresh_steps` sequential drafter steps on the online buffer after every policy
update (`drafter.where: sequential`, a fixed step count, not wall-clock dependent). From the same
warm-started drafter: *frozen* (never trained again) and *control* (the same refresher code and
step count on the warm-start corpus: more training without fresh data). Optionally, on the final
policy only, *oracle*: the adaptive drafter plus `--oracle-steps` steps on that policy's own rollouts
(the freshness ceiling: data no online refresh has yet, and a step budget of the caller's).

Metric, per policy snapshot t = 0 (before RL) .. steps: the policy's greedy responses on the
held-out prompts, one target forward for their hidden states, then every drafter teacher-forced
through a depth-4 chain (tlt.drafter.accept_eval): the exact greedy accept length of the
engine's rounds (tokens per verify pass) and the first-draft acceptance sum min(p, q) at the
rollout temperature -- no bandit, no timing. Drift per snapshot: share of greedy response tokens
that differ from the start policy's (position by position, length differences count), and the
mean token KL(pi_t || pi_0) over the current responses. Paired bootstrap CIs over prompts.
At the end one real SD run per arm (bench/rollout.py at batch 1, tuner off, fixed chain) on the
final policy. Figures and metrics go to MLflow (experiment `tlt-bench`, `--mlflow-uri`).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEPTH = 4
ARMS = ("frozen", "adaptive", "control")
_arms = harness.load("adaptive_arms")
share_drafter, control_refresher, oracle_drafter = _arms.share_drafter, _arms.control_refresher, _arms.oracle_drafter
rollout_samples = _arms.rollout_samples


def bench_config(config: str | None, overrides: list[str], steps: int, drafter_steps: int, rl_lr: float | None,
                 eval_prompts: int, out_dir: Path):
    """The run: SD off in the rollout, sequential refresh of `drafter_steps` steps after every update."""
    from tlt.config import load_config

    base = harness.run_overrides(out_dir) + [
        "rollout.spec=false", "drafter.where=sequential", "drafter.schedule=every_k", "drafter.refresh_every=1",
        f"drafter.refresh_steps={drafter_steps}", f"rl.steps={steps}", f"data.heldout_size={eval_prompts}"]
    if rl_lr is not None:
        base.append(f"rl.lr={rl_lr}")
    return load_config(config, base + list(overrides))


# ---------------------------------------------------------------- one policy snapshot
def token_drift(responses: list[list[int]], start: list[list[int]]) -> float:
    """Share of greedy response positions whose token differs from the start policy's (a position
    that only one of the two responses has counts as differing)."""
    diff = total = 0
    for a, b in zip(responses, start):
        n = max(len(a), len(b))
        diff += sum(1 for j in range(n) if j >= len(a) or j >= len(b) or a[j] != b[j])
        total += n
    return diff / max(total, 1)


@torch.no_grad()
def mean_kl(samples, prompt_lens: list[int], head: torch.Tensor, ref_model, batch: int = 8) -> float:
    """Mean over response tokens of KL(pi_t || pi_0) of the next-token distributions that produced
    them; pi_t from the recorded final hidden states, pi_0 from one `ref_model` forward per batch."""
    total, n = 0.0, 0
    for i in range(0, len(samples), batch):
        chunk, plens = samples[i:i + batch], prompt_lens[i:i + batch]
        L = max(s["input_ids"].shape[0] for s in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        attn = torch.zeros(len(chunk), L, dtype=torch.long)
        for j, s in enumerate(chunk):
            ids[j, :s["input_ids"].shape[0]] = s["input_ids"]
            attn[j, :s["input_ids"].shape[0]] = 1
        logits0 = ref_model(input_ids=ids, attention_mask=attn).logits
        for j, (s, P) in enumerate(zip(chunk, plens)):
            T = s["input_ids"].shape[0]
            if T - P < 1:
                continue
            lt = torch.log_softmax(s["target_hidden"][P - 1:T - 1].float() @ head.float().T, -1)
            l0 = torch.log_softmax(logits0[j, P - 1:T - 1].float(), -1)
            total += float((lt.exp() * (lt - l0)).sum())
            n += T - P
    return total / max(n, 1)


def snapshot(pipe, prompts, max_new: int, drafters: dict, ref_model, start_responses, temperature: float,
             kl_prompts: int) -> dict:
    """Greedy responses of the current policy, their features, drift (KL on the first `kl_prompts`
    prompts: pi_0 needs a forward of its own) and every arm's accept lengths."""
    from tlt.drafter.accept_eval import evaluate_drafter

    t0 = time.perf_counter()
    responses, samples = rollout_samples(pipe, prompts, 0.0, max_new=max_new)
    plens = [len(p) for p in prompts]
    head = pipe.model.get_output_embeddings().weight
    evals = {name: evaluate_drafter(d, samples, plens, DEPTH, temperature, head) for name, d in drafters.items()}
    rec = {"responses": responses, "samples": samples, "plens": plens, "evals": evals,
           "drift": 0.0 if start_responses is None else token_drift(responses, start_responses),
           "kl": 0.0 if start_responses is None else mean_kl(samples[:kl_prompts], plens[:kl_prompts], head, ref_model),
           "response_len": float(np.mean([len(r) for r in responses])), "eval_s": time.perf_counter() - t0}
    return rec


# ---------------------------------------------------------------- the real SD check
def sd_check(pipe, drafters: dict, out_dir: Path, row_prompts: int, max_new: int) -> dict:
    """bench/rollout.py at batch 1, tuner off, on the final policy, per arm (exported drafters)."""
    from tlt.export import export_eagle3

    rollout = harness.load("rollout")
    out = {}
    for name, d in drafters.items():
        path = export_eagle3(d, pipe.model.config, out_dir / f"drafter_{name}", force=True)
        res = rollout.run_bench(pipe.cfg, str(path), batches=(1,), max_new_tokens=max_new, reps=1, grpo=False,
                                model_and_tokenizer=(pipe.model, pipe.tokenizer), prompts="task",
                                row_prompts=row_prompts, tuner=False)
        row = res["rows"][0]
        out[name] = {"speedup_vs_plain": row["speedup_vs_plain"], "spec_tok_s": row["spec_tok_s"],
                     "plain_tok_s": row["plain_tok_s"], "accept_len": row["accept_len_mean"],
                     "accept_len_greedy_measure": res["accept_len_greedy"],
                     "accept_len_sampled_measure": res["accept_len_sampled"],
                     "greedy_identical": res["greedy_identical"]}
    return out


# ---------------------------------------------------------------- the run
def run(cfg, steps: int, max_new: int, sd_prompts: int, kl_prompts: int, out_dir: Path, tracker=None,
        oracle_steps: int = 0, oracle_prompts: int = 64) -> dict:
    from tlt.pipeline import Pipeline

    pipe = Pipeline(cfg)
    pipe.validate_data()
    pipe.prepare()
    corpus = pipe.build_corpus()  # once, with its captured features: warm-start and control share it
    ws = pipe.warmstart(corpus)
    prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
    frozen = share_drafter(pipe.drafter)
    d = cfg.drafter
    control = control_refresher(pipe, corpus, 2 * steps * d.refresh_steps * d.batch_tokens)
    drafters = {"frozen": frozen, "adaptive": pipe.drafter, "control": control.drafter}
    ref_model = copy.deepcopy(pipe.model).eval()  # pi_0, for KL(pi_t || pi_0)
    temp = cfg.rollout.temperature or 1.0
    snaps = [snapshot(pipe, prompts, max_new, drafters, ref_model, None, temp, kl_prompts)]
    log_snapshot(tracker, 0, snaps[0])
    try:
        steps_log = trajectory(pipe, control, prompts, steps, snaps, drafters, ref_model, max_new, temp,
                               kl_prompts, tracker)
        final = final_checks(pipe, drafters, snaps[-1], temp, oracle_steps, oracle_prompts)
        sd = sd_check(pipe, {"frozen": frozen, "adaptive": pipe.drafter}, out_dir, sd_prompts, max_new) \
            if sd_prompts else None
    finally:
        pipe.close()
    return {"snaps": snaps, "steps": steps_log, "warmstart": ws, **final, "sd_check": sd, "cfg": cfg}


def trajectory(pipe, control, prompts: list[list[int]], steps: int, snaps: list, drafters: dict, ref_model,
               max_new: int, temp: float, kl_prompts: int, tracker) -> list[dict]:
    """`steps` RL steps (the pipeline refreshes the adaptive drafter; the control refreshes on its
    corpus), a snapshot of every arm after each; returns the per-step timing and loss log."""
    start = snaps[0]["responses"]
    steps_log = []
    for step in range(steps):
        s = pipe.rl_step(step)
        c = control.refresh(step)
        m = s.metrics
        steps_log.append({"step_s": m["timing_s/step"], "drafter_s": m.get("timing_s/update_drafter", 0.0),
                          "drafter_steps": m.get("drafter/steps", 0.0), "control_steps": c.get("drafter/steps", 0.0),
                          "reward_mean": m["reward/mean"], "buffer_tokens": m.get("drafter/buffer_tokens", 0.0),
                          "drafter_loss": m.get("drafter/loss"), "control_loss": c.get("drafter/loss")})
        for rec in snaps:  # only the newest snapshot's features are needed again
            rec.pop("samples", None)
        snaps.append(snapshot(pipe, prompts, max_new, drafters, ref_model, start, temp, kl_prompts))
        log_snapshot(tracker, step + 1, snaps[-1])
        e = snaps[-1]["evals"]
        print(f"step {step + 1}: drift {snaps[-1]['drift']:.3f}, KL {snaps[-1]['kl']:.4f}, accept "
              + ", ".join(f"{a} {e[a].accept_len:.3f}" for a in ARMS)
              + f" | RL step {m['timing_s/step']:.1f} s, drafter {steps_log[-1]['drafter_s']:.2f} s, "
              f"reward {m['reward/mean']:.3f}", flush=True)
    return steps_log


def final_checks(pipe, drafters: dict, last: dict, temp: float, oracle_steps: int, oracle_prompts: int) -> dict:
    """On the final policy: the optional oracle arm, then frozen and adaptive evaluated again (the
    oracle trained a copy; the arms' own drafters must be untouched)."""
    from tlt.drafter.accept_eval import evaluate_drafter

    head = pipe.model.get_output_embeddings().weight
    oracle = None
    if oracle_steps:
        od, info = oracle_drafter(pipe, oracle_prompts, oracle_steps, temp)
        oracle = {**info, "eval": evaluate_drafter(od, last["samples"], last["plens"], DEPTH, temp, head)}
        print(f"oracle: {info['steps']} steps on {info['prompts']} rollouts of the final policy "
              f"({info['buffer_tokens']} tokens) -> accept {oracle['eval'].accept_len:.3f}", flush=True)
    out = {"oracle": oracle}
    for name in ("frozen", "adaptive"):
        again = evaluate_drafter(drafters[name], last["samples"], last["plens"], DEPTH, temp, head)
        out[f"{name}_recheck_equal"] = bool(again.tokens.tolist() == last["evals"][name].tokens.tolist()
                                            and again.passes.tolist() == last["evals"][name].passes.tolist())
    return out


def log_snapshot(tracker, step: int, rec: dict) -> None:
    if tracker is None:
        return
    m = {"adaptive/drift_token_share": rec["drift"], "adaptive/kl": rec["kl"],
         "adaptive/response_length": rec["response_len"]}
    for name, ev in rec["evals"].items():
        m[f"adaptive/accept_len/{name}"] = ev.accept_len
        m[f"adaptive/first_accept/{name}"] = ev.first_accept
    tracker.log_metrics(m, step=step)


def summarize(out: dict, steps: int, drafter_steps: int) -> dict:
    from tlt.drafter.accept_eval import accept_ratio_ci

    snaps, log = out["snaps"], out["steps"]
    acc = {a: [s["evals"][a].accept_len for s in snaps] for a in ARMS}
    first = {a: [s["evals"][a].first_accept for s in snaps] for a in ARMS}
    pos = {a: [s["evals"][a].accept_pos for s in snaps] for a in ARMS}
    last = snaps[-1]["evals"]
    rl_s = [s["step_s"] for s in log]
    dr_s = [s["drafter_s"] for s in log]
    n_steps = np.diff([0.0] + [s["drafter_steps"] for s in log]).tolist()
    cfg = out["cfg"]
    res = {"steps": steps, "snapshots": "index 0 = the start policy (before RL), index t = after t RL steps",
           "eval_prompts": len(snaps[0]["responses"]), "depth": DEPTH,
           "drift_token_share": [s["drift"] for s in snaps], "kl": [s["kl"] for s in snaps],
           "response_length": [s["response_len"] for s in snaps],
           **{f"accept_{a}": acc[a] for a in ARMS},
           **{f"first_accept_{a}": first[a] for a in ARMS},
           **{f"accept_pos_{a}": pos[a] for a in ARMS},
           "gain_vs_frozen": acc["adaptive"][-1] / acc["frozen"][-1],
           "gain_vs_control": acc["adaptive"][-1] / acc["control"][-1],
           "gain_vs_frozen_ci": accept_ratio_ci(last["adaptive"], last["frozen"]),
           "gain_vs_control_ci": accept_ratio_ci(last["adaptive"], last["control"]),
           "drafter_steps_per_rl_step": float(np.mean(n_steps)) if n_steps else 0.0,
           "drafter_steps_configured": drafter_steps,
           "drafter_s_per_rl_step": float(np.mean(dr_s)) if dr_s else 0.0,
           "rl_step_s": float(np.mean(rl_s)) if rl_s else 0.0,
           "drafter_share_of_rl_step": float(sum(dr_s) / max(sum(rl_s), 1e-9)),
           "reward_mean": [s["reward_mean"] for s in log],
           "frozen_recheck_equal": out["frozen_recheck_equal"],
           "adaptive_recheck_equal": out["adaptive_recheck_equal"],
           "warmstart_accept_len": out["warmstart"].accept_len_after,
           "rl_lr": cfg.rl.lr, "rollout_temperature": cfg.rollout.temperature,
           "sd_check": out["sd_check"], "per_step": log}
    if out.get("oracle"):
        o = out["oracle"]
        res.update({"accept_oracle": o["eval"].accept_len, "first_accept_oracle": o["eval"].first_accept,
                    "oracle_gain_vs_frozen": o["eval"].accept_len / acc["frozen"][-1],
                    "oracle_gain_vs_frozen_ci": accept_ratio_ci(o["eval"], last["frozen"]),
                    "oracle_gain_vs_adaptive": o["eval"].accept_len / acc["adaptive"][-1],
                    "oracle_steps": o["steps"], "oracle_prompts": o["prompts"],
                    "oracle_buffer_tokens": o["buffer_tokens"], "oracle_train_s": o["train_s"]})
    return res


def print_table(res: dict) -> None:
    print(f"\n{'step':>4} {'drift':>6} {'KL':>7} " + " ".join(f"{a:>9}" for a in ARMS)
          + "  first-draft accept at T (frozen / adaptive / control)")
    for t in range(len(res["drift_token_share"])):
        print(f"{t:>4} {res['drift_token_share'][t]:>6.3f} {res['kl'][t]:>7.4f} "
              + " ".join(f"{res[f'accept_{a}'][t]:>9.3f}" for a in ARMS) + "  "
              + " / ".join(f"{res[f'first_accept_{a}'][t]:.3f}" for a in ARMS))
    lo, hi = res["gain_vs_frozen_ci"]
    print(f"\nadaptive vs frozen x{res['gain_vs_frozen']:.3f} (95 % CI {lo:.3f}-{hi:.3f}), vs control "
          f"x{res['gain_vs_control']:.3f}; drafter {res['drafter_steps_per_rl_step']:.1f} steps, "
          f"{res['drafter_s_per_rl_step']:.2f} s per RL step ({100 * res['drafter_share_of_rl_step']:.1f} % of "
          f"{res['rl_step_s']:.1f} s); frozen recomputed identically: {res['frozen_recheck_equal']}")
    if "accept_oracle" in res:
        lo, hi = res["oracle_gain_vs_frozen_ci"]
        print(f"oracle (adaptive + {res['oracle_steps']} steps on the final policy's own rollouts): accept "
              f"{res['accept_oracle']:.3f}, x{res['oracle_gain_vs_frozen']:.3f} vs frozen (95 % CI {lo:.3f}-{hi:.3f}), "
              f"x{res['oracle_gain_vs_adaptive']:.3f} vs adaptive")
    for name, row in (res["sd_check"] or {}).items():
        print(f"SD check {name:>8}: x{row['speedup_vs_plain']:.2f} vs plain at batch 1, accept {row['accept_len']:.2f}"
              f" (measure_accept greedy {row['accept_len_greedy_measure']:.2f}), greedy identical "
              f"{row['greedy_identical']}")


def log_to_mlflow(tracker, res: dict) -> None:
    from tlt.plots import accept_vs_drift

    tracker.log_params({"rl_lr": res["rl_lr"], "steps": res["steps"], "eval_prompts": res["eval_prompts"],
                        "drafter_steps": res["drafter_steps_configured"]})
    tracker.log_metrics({"adaptive/gain_vs_frozen": res["gain_vs_frozen"],
                         "adaptive/gain_vs_control": res["gain_vs_control"],
                         "adaptive/gain_vs_frozen_ci_low": res["gain_vs_frozen_ci"][0],
                         "adaptive/drafter_s_per_rl_step": res["drafter_s_per_rl_step"],
                         **({"adaptive/accept_len/oracle": res["accept_oracle"],
                             "adaptive/oracle_gain_vs_frozen": res["oracle_gain_vs_frozen"]}
                            if "accept_oracle" in res else {})}, step=res["steps"])
    fig = accept_vs_drift(res["drift_token_share"], {a: res[f"accept_{a}"] for a in ARMS}, res["kl"])
    tracker.log_figure(fig, "adaptive/accept_vs_drift.png")
    tracker.log_dict(res, "adaptive/result.json")


def _parser() -> argparse.ArgumentParser:
    ap = harness.parser(__doc__, steps=5, out_dir=True)
    ap.add_argument("--rl-lr", type=float, default=1e-4, help="policy LR of the trajectory (drift); 0 = the config's")
    ap.add_argument("--drafter-steps", type=int, default=None,
                    help="drafter steps per RL step, adaptive and control (default: drafter.refresh_steps)")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts (data.heldout_size)")
    ap.add_argument("--eval-tokens", type=int, default=48, help="greedy tokens per held-out prompt")
    ap.add_argument("--kl-prompts", type=int, default=16, help="held-out prompts of the KL estimate")
    ap.add_argument("--sd-prompts", type=int, default=8, help="prompts of the final SD check (0 = skip it)")
    ap.add_argument("--oracle-steps", type=int, default=0,
                    help="also an oracle arm on the final policy: the adaptive drafter plus this many steps on the "
                    "final policy's own rollouts (0 = no oracle)")
    ap.add_argument("--oracle-prompts", type=int, default=64, help="training prompts of the oracle's rollouts")
    ap.add_argument("--mlflow-uri", default=None, help="tracking store (default: the project's mlflow/)")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's; 1 is "
                    "faster than 2 on a 2-core box that other jobs share)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tlt.config import load_config

    n_drafter = args.drafter_steps or load_config(args.config, args.overrides).drafter.refresh_steps
    tracker = None
    if not args.no_mlflow:
        from tlt.tracking import MlflowTracker

        tracker = MlflowTracker("tlt-bench", run_name="adaptive", uri=args.mlflow_uri)
    try:
        with harness.workdir(args.out_dir, "tlt-bench-adaptive-") as out_dir:
            cfg = bench_config(args.config, args.overrides, args.steps, n_drafter, args.rl_lr or None,
                               args.eval_prompts, out_dir / "runs")
            out = run(cfg, args.steps, args.eval_tokens, args.sd_prompts, args.kl_prompts, out_dir, tracker,
                      oracle_steps=args.oracle_steps, oracle_prompts=args.oracle_prompts)
        res = summarize(out, args.steps, n_drafter)
        if tracker is not None:
            log_to_mlflow(tracker, res)
            res["mlflow_run_id"] = tracker.run_id
    finally:
        if tracker is not None:
            tracker.end()
    print_table(res)
    return harness.write_result(res, "adaptive", args, argv)


if __name__ == "__main__":
    main()
