"""The online drafter: how it keeps up with policy drift, and what each refresh schedule costs an RL step.

    python bench/adaptive.py conf/default.yaml --json out.json [--steps 5] [--rl-lr 1e-4] [--drafter-steps 4]
        [--eval-prompts 64] [--eval-tokens 48] [--oracle-steps 32] [--set k=v ...]
    python bench/adaptive.py conf/default.yaml --schedules none,spot,sequential --steps 3 [--drafter-steps 4]
    python bench/adaptive.py conf/default.yaml --schedules frozen,every_k,payoff --steps 8
"""
import copy
import time
from pathlib import Path

import numpy as np
import torch

import harness
from tlt.drafter.accept_eval import accept_ratio_ci, evaluate_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.train import DrafterTrainer
from tlt.drafter.eagle3 import export_eagle3
from tlt.plots import accept_vs_drift
from tlt.distill import corpus_samples, heldout_accept

DEPTH = 4
ARMS = ("frozen", "adaptive", "control")
SCHEDULES = {"none": ["drafter.schedule=frozen"], "spot": ["drafter.where=spot"],  # these three: SD as configured
             "sequential": ["drafter.where=sequential"], "frozen": ["rollout.spec=true", "drafter.schedule=frozen"],
             "every_k": ["rollout.spec=true", "drafter.schedule=every_k", "drafter.refresh_every=1"],
             "payoff": ["rollout.spec=true", "drafter.schedule=payoff"]}
SCHEDULE_KEYS = ("step_s", "rollout_s", "update_policy_s", "drafter_s", "drafter_steps", "spec_enabled_share",
                 "tail_share", "accept_len")
FLAGS = (("--schedules", None, f"compare these schedules instead ({','.join(SCHEDULES)})"),
         ("--rl-lr", 1e-4, "policy LR of the trajectory (drift); 0 = the config's"),
         ("--drafter-steps", None, "drafter steps per RL step (default: drafter.refresh_steps)", int),
         ("--eval-prompts", 64, "held-out prompts (data.heldout_size)"), ("--eval-tokens", 48, "greedy tokens each"),
         ("--kl-prompts", 16, "of them in the KL estimate"), ("--sd-prompts", 8, "end SD check's prompts (0: none)"),
         ("--oracle-steps", 0, "oracle arm's extra steps (0: none)"), ("--oracle-prompts", 64, "its rollouts' prompts"),
         ("--mlflow-uri", None, "tracking store (default: the project's mlflow/)"), ("--no-mlflow", False, "no MLflow"))


# ---------------------------------------------------------------- drift: the arms' drafters
def share_drafter(drafter):
    """A copy of the drafter's own weights that shares the *target's* embedding and head."""
    keep = {id(drafter.embed_weight): drafter.embed_weight}
    if drafter.target_head is not None:
        keep[id(drafter.target_head)] = drafter.target_head
    return copy.deepcopy(drafter, memo=keep)


def refresher_copy(pipe, seed: int, **updates):
    """A DrafterRefresher over a copy of the pipeline's drafter and optimizer state, with a buffer
    large enough for anything the arm feeds it; `updates` override drafter config keys."""
    d = pipe.cfg.drafter
    trainer = DrafterTrainer(share_drafter(pipe.drafter), d, pipe.model.get_output_embeddings().weight)
    state = pipe.refresher.state_dict()
    trainer.load_state_dict(copy.deepcopy({k: state[k] for k in ("drafter", "optimizer", "num_steps")}))
    return DrafterRefresher(trainer, d.model_copy(update={"buffer_max_tokens": max(d.buffer_max_tokens, 1 << 22),
                                                           **updates}), seed=seed)


def control_refresher(pipe, corpus, need_tokens: int):
    """The refresher code on a copy of the warm-started drafter, its buffer filled once with a seeded
    random subset of >= `need_tokens` warm-start corpus tokens (re-forwarded only that far)."""
    ref = refresher_copy(pipe, pipe.cfg.rl.seed)
    order = np.random.default_rng(pipe.cfg.rl.seed).permutation(len(corpus))
    sizes = [len(corpus.prompt_ids[i]) + len(corpus.response_ids[i]) for i in order]
    keep = [int(i) for i, before in zip(order, np.cumsum([0] + sizes[:-1])) if before < need_tokens]
    sub = copy.copy(corpus)
    for field in ("prompt_ids", "response_ids", "features"):
        setattr(sub, field, None if getattr(corpus, field) is None else [getattr(corpus, field)[i] for i in keep])
    for s, p in zip(corpus_samples(pipe.model, sub, ref.aux_layer_ids, pipe.cfg), sub.prompt_ids):
        ref.buffer.add(0, s["input_ids"], s["aux"], s["target_hidden"], torch.arange(s["input_ids"].shape[0]) >= len(p))
    return ref


def oracle_drafter(pipe, n_prompts: int, n_steps: int):
    """The freshness ceiling: a copy of the adaptive drafter trained `n_steps` more steps on the final
    policy's own rollouts of `n_prompts` seeded training prompts (at the rollout temperature)."""
    seed = pipe.cfg.rl.seed + 1
    ref = refresher_copy(pipe, seed, refresh_steps=n_steps)
    train = list(pipe.dataset.train["prompt"])
    prompts = pipe.prompt_ids([train[i] for i in np.random.default_rng(seed).permutation(len(train))[:n_prompts]])
    for s in rollout_samples(pipe, prompts, pipe.cfg.rollout.temperature or 1.0, seed=seed)[1]:
        ref.buffer.add(0, s["input_ids"], s["aux"], s["target_hidden"], s["loss_mask"])
    m = ref.refresh(0)
    return ref.drafter, {"steps": int(m.get("drafter/steps", 0)), "train_s": m.get("drafter/train_s", 0.0),
                         "buffer_tokens": int(m.get("drafter/buffer_tokens", 0)), "prompts": len(prompts)}


# ---------------------------------------------------------------- drift: one policy snapshot
@torch.no_grad()
def rollout_samples(pipe, prompts: list[list[int]], temperature: float, seed: int = 0, max_new: int | None = None):
    """The policy's responses (EOS kept; chunk i of 16 prompts sampled with seed `seed + i`) and drafter
    samples over prompt + response, target features recorded by the decoding forwards."""
    responses, samples = [], []
    for i in range(0, len(prompts), 16):
        out = pipe.engine.generate(prompts[i:i + 16], max_new_tokens=max_new, temperature=temperature, seed=seed + i,
                                   spec=False, capture=pipe.drafter.aux_layer_ids)
        for p, r, (aux, fin) in zip(prompts[i:i + 16], out.response_ids, out.features):
            responses.append(list(r))
            samples.append({"input_ids": torch.tensor(p + list(r), dtype=torch.long), "aux": aux, "target_hidden": fin,
                            "loss_mask": torch.arange(len(p) + len(r)) >= len(p)})
    return responses, samples


def token_drift(responses: list[list[int]], start: list[list[int]]) -> float:
    """Share of greedy response positions whose token differs from the start policy's (a position only
    one of the two responses has counts as differing)."""
    pairs = list(zip(responses, start))
    diff = sum(1 for a, b in pairs for j in range(max(len(a), len(b))) if j >= min(len(a), len(b)) or a[j] != b[j])
    return diff / max(sum(max(len(a), len(b)) for a, b in pairs), 1)


@torch.no_grad()
def mean_kl(samples, plens: list[int], head: torch.Tensor, ref_model, batch: int = 8) -> float:
    """Mean over response tokens of KL(pi_t || pi_0): pi_t from the recorded final hidden states,
    pi_0 from one `ref_model` forward per batch."""
    total, n = 0.0, 0
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in chunk], batch_first=True)
        attn = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s["input_ids"]) for s in chunk], batch_first=True)
        logits0 = ref_model(input_ids=ids, attention_mask=attn).logits
        for j, (s, P) in enumerate(zip(chunk, plens[i:i + batch])):
            T = s["input_ids"].shape[0]
            lt = torch.log_softmax(s["target_hidden"][P - 1:T - 1].float() @ head.float().T, -1)
            total += float((lt.exp() * (lt - torch.log_softmax(logits0[j, P - 1:T - 1].float(), -1))).sum())
            n += max(T - P, 0)
    return total / max(n, 1)


def accept(pipe, drafter, snap: dict):
    return evaluate_drafter(drafter, snap["samples"], snap["plens"], DEPTH, pipe.cfg.rollout.temperature or 1.0,
                            pipe.model.get_output_embeddings().weight)


def snapshot(pipe, prompts, args, drafters: dict, ref_model, start, tracker, step: int) -> dict:
    """Greedy responses of the current policy, drift against `start` (KL on the first --kl-prompts)
    and every arm's accept lengths, logged to `tracker` at `step`."""
    t0 = time.perf_counter()
    responses, samples = rollout_samples(pipe, prompts, 0.0, max_new=args.eval_tokens)
    snap = {"responses": responses, "samples": samples, "plens": [len(p) for p in prompts],
            "response_len": float(np.mean([len(r) for r in responses]))}
    k, head = args.kl_prompts, pipe.model.get_output_embeddings().weight
    snap.update(evals={a: accept(pipe, d, snap) for a, d in drafters.items()},
                drift=0.0 if start is None else token_drift(responses, start),
                kl=0.0 if start is None else mean_kl(samples[:k], snap["plens"][:k], head, ref_model),
                eval_s=time.perf_counter() - t0)
    tracker.log_metrics({"adaptive/drift_token_share": snap["drift"], "adaptive/kl": snap["kl"],
                         "adaptive/response_length": snap["response_len"],
                         **{f"adaptive/{k}/{a}": getattr(e, k) for a, e in snap["evals"].items()
                            for k in ("accept_len", "first_accept")}}, step=step)
    return snap


def sd_check(pipe, drafters: dict, out_dir: Path, args) -> dict:
    """bench/rollout.py at batch 1, tuner off, on the final policy, per arm (exported drafters)."""
    out = {}
    for name, d in drafters.items():
        path = export_eagle3(d, pipe.model.config, out_dir / f"drafter_{name}", force=True)
        res = harness.load("rollout").run_bench(pipe.cfg, str(path), batches=(1,), max_new_tokens=args.eval_tokens,
                                                reps=1, grpo=False, model_and_tokenizer=(pipe.model, pipe.tokenizer),
                                                prompts="task", row_prompts=args.sd_prompts)
        row = res["rows"][0]
        out[name] = {**{k: row[k] for k in ("speedup_vs_plain", "spec_tok_s", "plain_tok_s")},
                     "accept_len": row["accept_len_mean"], "greedy_identical": res["greedy_identical"],
                     **{f"{k}_measure": res[k] for k in ("accept_len_greedy", "accept_len_sampled")}}
    return out


# ---------------------------------------------------------------- drift: the run
def run_drift(args, out_dir: Path, tracker) -> dict:
    d = harness.config(args).drafter
    n_drafter = args.drafter_steps or d.refresh_steps
    cfg = harness.config(args, base=(*harness.run_overrides(out_dir / "runs"), "rollout.spec=false",
                                     "drafter.where=sequential", "drafter.schedule=every_k", "drafter.refresh_every=1",
                                     f"drafter.refresh_steps={n_drafter}", f"rl.steps={args.steps}",
                                     f"data.heldout_size={args.eval_prompts}",
                                     *([f"rl.lr={args.rl_lr}"] if args.rl_lr else [])))
    with harness.pipelines({"adaptive": cfg}) as pipes:
        pipe = pipes["adaptive"]
        corpus = pipe.build_corpus()  # once, with its captured features: warm-start and control share it
        ws = pipe.warmstart(corpus)
        prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
        control = control_refresher(pipe, corpus, 2 * args.steps * n_drafter * d.batch_tokens)
        drafters = {"frozen": share_drafter(pipe.drafter), "adaptive": pipe.drafter, "control": control.drafter}
        ref_model = copy.deepcopy(pipe.model).eval()  # pi_0, for KL(pi_t || pi_0)
        snaps, log = [snapshot(pipe, prompts, args, drafters, ref_model, None, tracker, 0)], []
        for step in range(args.steps):
            m, c = pipe.rl_step(step).metrics, control.refresh(step)
            log.append({"step_s": m["timing_s/step"], "drafter_s": m.get("timing_s/update_drafter", 0.0),
                        "drafter_steps": m.get("drafter/steps", 0.0), "control_steps": c.get("drafter/steps", 0.0),
                        "reward_mean": m["reward/mean"], "buffer_tokens": m.get("drafter/buffer_tokens", 0.0),
                        "drafter_loss": m.get("drafter/loss"), "control_loss": c.get("drafter/loss")})
            snaps[-1].pop("samples")  # only the newest snapshot's features are needed again
            snaps.append(snapshot(pipe, prompts, args, drafters, ref_model, snaps[0]["responses"], tracker, step + 1))
            print(f"step {step + 1}: drift {snaps[-1]['drift']:.3f}, KL {snaps[-1]['kl']:.4f}, accept " + ", ".join(
                f"{a} {snaps[-1]['evals'][a].accept_len:.3f}" for a in ARMS), flush=True)
        out = {"snaps": snaps, "steps": log, "warmstart": ws, "cfg": pipe.cfg, "n_drafter": n_drafter, "oracle": None}
        if args.oracle_steps:
            od, info = oracle_drafter(pipe, args.oracle_prompts, args.oracle_steps)
            out["oracle"] = {**info, "eval": accept(pipe, od, snaps[-1])}
        for name in ("frozen", "adaptive"):  # the oracle trained a copy: the arms' drafters are untouched
            again, before = accept(pipe, drafters[name], snaps[-1]), snaps[-1]["evals"][name]
            out[f"{name}_recheck_equal"] = bool(again.tokens.tolist() == before.tokens.tolist()
                                                and again.passes.tolist() == before.passes.tolist())
        out["sd_check"] = sd_check(pipe, {"frozen": drafters["frozen"], "adaptive": pipe.drafter}, out_dir, args) \
            if args.sd_prompts else None
    return out


def summarize_drift(out: dict, steps: int) -> dict:
    snaps, log, last = out["snaps"], out["steps"], out["snaps"][-1]["evals"]
    acc = {a: [s["evals"][a].accept_len for s in snaps] for a in ARMS}
    rl_s, dr_s = [s["step_s"] for s in log], [s["drafter_s"] for s in log]
    n_steps = np.diff([0.0] + [s["drafter_steps"] for s in log])
    res = {"steps": steps, "snapshots": "index 0 = the start policy (before RL), index t = after t RL steps",
           "eval_prompts": len(snaps[0]["responses"]), "depth": DEPTH,
           "drift_token_share": [s["drift"] for s in snaps], "kl": [s["kl"] for s in snaps],
           "response_length": [s["response_len"] for s in snaps],
           **{f"{key}_{a}": [getattr(s["evals"][a], field) for s in snaps] for a in ARMS
              for key, field in (("accept", "accept_len"), ("first_accept", "first_accept"),
                                 ("accept_pos", "accept_pos"))},
           **{f"gain_vs_{b}": acc["adaptive"][-1] / acc[b][-1] for b in ("frozen", "control")},
           **{f"gain_vs_{b}_ci": accept_ratio_ci(last["adaptive"], last[b]) for b in ("frozen", "control")},
           "drafter_steps_per_rl_step": float(np.mean(n_steps)) if log else 0.0,
           "drafter_s_per_rl_step": float(np.mean(dr_s)) if log else 0.0,
           "rl_step_s": float(np.mean(rl_s)) if log else 0.0, "drafter_steps_configured": out["n_drafter"],
           "drafter_share_of_rl_step": float(sum(dr_s) / max(sum(rl_s), 1e-9)),
           "reward_mean": [s["reward_mean"] for s in log],
           **{f"{a}_recheck_equal": out[f"{a}_recheck_equal"] for a in ("frozen", "adaptive")},
           "warmstart_accept_len": out["warmstart"].accept_len_after, "rl_lr": out["cfg"].rl.lr,
           "rollout_temperature": out["cfg"].rollout.temperature, "sd_check": out["sd_check"], "per_step": log}
    if o := out["oracle"]:
        e = o.pop("eval")
        res.update({"accept_oracle": e.accept_len, "first_accept_oracle": e.first_accept,
                    "oracle_gain_vs_frozen": e.accept_len / acc["frozen"][-1],
                    "oracle_gain_vs_frozen_ci": accept_ratio_ci(e, last["frozen"]),
                    "oracle_gain_vs_adaptive": e.accept_len / acc["adaptive"][-1],
                    **{f"oracle_{k}": v for k, v in o.items()}})
    return res


# ---------------------------------------------------------------- schedules
def run_schedules(args, out_dir: Path) -> dict:
    """One run per schedule, interleaved; per arm and step the drafter steps trained in that step and
    the held-out accept length after it (index 0: after the warm-start); payoff's mean accept length
    after the steps and its drafter seconds over every_k's."""
    arms, accept = args.schedules.split(","), {}
    base = (*harness.run_overrides(out_dir / "runs", args.steps),
            *([f"drafter.refresh_steps={args.drafter_steps}"] if args.drafter_steps else []))

    def measure(arm, p, record=None):  # the held-out greedy accept length (tuner off, drafter.eval_strategy)
        prompts = p.prompt_ids(p.dataset.heldout["prompt"][: p.cfg.drafter.warmstart_eval_prompts])
        accept.setdefault(arm, []).append(heldout_accept(p.engine, prompts, p.cfg, 0.0).accept_len)

    with harness.pipelines({a: harness.config(args, *SCHEDULES[a], f"name={a}", base=base) for a in arms}) as pipes:
        for a, p in pipes.items():
            p.warmstart()
            measure(a, p)
        recs = harness.run_steps(pipes, args.steps, measure)
        budget = next(iter(pipes.values())).cfg.drafter.refresh_steps
    for runs in recs.values():
        total = 0.0
        for r in runs:
            r["drafter_s"], now = r["update_drafter_s"], r["drafter_steps_total"] or total
            r["drafter_steps"], total = now - total, now
    per_step = {a: [{k: r[k] for k in SCHEDULE_KEYS} for r in runs] for a, runs in recs.items()}
    mean = {a: {k: harness.mean_excluding_first([r[k] or 0.0 for r in runs]) for k in SCHEDULE_KEYS[:-1]}
            for a, runs in per_step.items()}
    for m in mean.values():
        m["drafter_share_of_step"] = m["drafter_s"] / m["step_s"]
        m.update({f"{k}_slowdown_vs_none": m[f"{k}_s"] / mean["none"][f"{k}_s"] for k in ("rollout", "step")}
                 if "none" in mean else {})
    res = {"steps": args.steps, "excluded_from_means": "step 0 (empty buffer)", "drafter_steps_budget": budget,
           "arms": mean, "per_step": per_step}
    for a, runs in recs.items():
        res.update({f"accept_len_{a}": accept[a], f"drafter_s_{a}": sum(r["drafter_train_s"] or 0.0 for r in runs),
                    f"drafter_steps_{a}": max([r["drafter_steps_total"] or 0.0 for r in runs], default=0.0)})
    if {"payoff", "every_k"} <= set(recs):
        res["payoff_accept_ratio"] = float(np.mean(accept["payoff"][1:]) / np.mean(accept["every_k"][1:]))
        res["payoff_drafter_time_ratio"] = res["drafter_s_payoff"] / max(res["drafter_s_every_k"], 1e-9)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, *FLAGS, steps=5, out_dir=True, threads=True)
    args = harness.parse(ap, argv)
    if args.schedules and not set(args.schedules.split(",")) <= set(SCHEDULES):
        ap.error(f"--schedules {args.schedules}: the arms are comma-separated names from {', '.join(SCHEDULES)}")
    if args.schedules:
        with harness.workdir(args.out_dir, "tlt-bench-schedules-") as out_dir:
            return harness.write_result(run_schedules(args, out_dir), "adaptive", args, argv)
    from tlt.tracking import MlflowTracker, NullTracker

    tracker = NullTracker() if args.no_mlflow else MlflowTracker("tlt-bench", run_name="adaptive", uri=args.mlflow_uri)
    try:
        with harness.workdir(args.out_dir, "tlt-bench-adaptive-") as out_dir:
            res = summarize_drift(run_drift(args, out_dir, tracker), args.steps)
        tracker.log_params({"rl_lr": res["rl_lr"], "steps": res["steps"], "eval_prompts": res["eval_prompts"],
                            "drafter_steps": res["drafter_steps_configured"]})
        keys = ("gain_vs_frozen", "gain_vs_control", "drafter_s_per_rl_step", "accept_oracle", "oracle_gain_vs_frozen")
        tracker.log_metrics({f"adaptive/{k}": res[k] for k in keys if k in res}
                            | {"adaptive/gain_vs_frozen_ci_low": res["gain_vs_frozen_ci"][0]}, step=res["steps"])
        tracker.log_figure(accept_vs_drift(res["drift_token_share"], {a: res[f"accept_{a}"] for a in ARMS}, res["kl"]),
                           "adaptive/accept_vs_drift.png")
        tracker.log_dict(res, "adaptive/result.json")
        if tracker.run_id is not None:  # not with --no-mlflow
            res["mlflow_run_id"] = tracker.run_id
    finally:
        tracker.end()
    return harness.write_result(res, "adaptive", args, argv)


if __name__ == "__main__":
    main()
