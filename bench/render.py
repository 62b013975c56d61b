"""Render the committed benchmark results into the docs and the README.

    python bench/render.py            rewrite the generated blocks
    python bench/render.py --check    exit 1 when a generated block disagrees with bench/results/*.json

Every number printed comes from a JSON file in bench/results/ and links to it; each file's
provenance header (command line, commit, machine, date, config hash; written by
bench/harness.py) is listed next to the tables. Blocks are delimited by
`<!-- results:NAME:start -->` / `<!-- results:NAME:end -->` in docs/performance.md (NAME = index,
precision, parity) and README.md (NAME = status). tests/test_results.py runs the check.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGES = {"README.md": "bench/results", "docs/performance.md": "results"}  # page -> link prefix to the files
NOT_MEASURED = "not measured in committed results"


def load_results() -> dict[str, dict]:
    """name (file stem) -> the JSON of every committed result."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


def suite(res: dict) -> str:
    """The benchmark script that wrote a result (from its command line)."""
    cmd = res.get("command", "").split()
    return Path(cmd[1]).stem if len(cmd) > 1 else "?"


def recipe(res: dict) -> str:
    cmd = res.get("command", "").split()
    return cmd[2] if len(cmd) > 2 else "?"


def engine_of(res: dict) -> str:
    """The rollout engine a result ran on (its command's overrides), and without the start-up calibration
    where the command switched it off."""
    engine = "vLLM" if "rollout.backend=vllm" in res["command"] else "torch engine"
    return engine + (", no start-up calibration" if "rollout.tuner_calibrate=false" in res["command"] else "")


def x(v: float) -> str:
    return f"{v:.2f}×"


# ---------------------------------------------------------------- blocks
def index_block(results: dict, prefix: str) -> str:
    """Compact provenance: one short row per file (the full command is in the file's header)."""
    rows = ["| file | suite | recipe | commit | machine | date |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| [{name}.json]({prefix}/{name}.json) | `{suite(r)}` | `{recipe(r)}` | `{r['commit'][:7]}` | "
                    f"{r['machine']} | {r['date'][:10]} |")
    return "\n".join(rows)


PRECISION_ROWS = [  # (label, cell from one precision result)
    ("RL step", lambda r: f"{r['step_s_fp32']:.1f} → {r['step_s_bf16']:.1f} s, **{x(r['step_speedup'])}**"),
    ("policy update", lambda r: f"{r['update_s_fp32']:.1f} → {r['update_s_bf16']:.1f} s, {x(r['update_speedup'])}"),
    ("rollout in the RL step (SD, spot trainer)",
     lambda r: f"{r['rollout_s_fp32']:.1f} → {r['rollout_s_bf16']:.1f} s, {x(r['rollout_speedup_bf16'])}"),
    ("rollout tokens/s, plain / SD (held-out prompts)",
     lambda r: f"{x(r['rollout_tok_s_speedup_plain'])} / {x(r['rollout_tok_s_speedup_sd'])}"),
    ("SD / plain tokens/s, fp32 → bf16", lambda r: f"{x(sd_ratio(r, 'fp32'))} → {x(sd_ratio(r, 'bf16'))}"),
    ("drafter warm-start, per step",
     lambda r: f"{r['warmstart_s_fp32'] / r['warmstart_steps']:.2f} → {r['warmstart_s_bf16'] / r['warmstart_steps']:.2f} s, "
               f"{x(r['warmstart_speedup'])}"),
    ("held-out accept length after warm-start (fixed chain, greedy)",
     lambda r: f"{r['accept_len_fp32']:.2f} → {r['accept_len_bf16']:.2f}"),
    ("held-out greedy accuracy after the last step", lambda r: f"{r['accuracy_fp32']:.2f} → {r['accuracy_bf16']:.2f}"),
    ("reward curves, paired permutation test",
     lambda r: f"p = {r['parity_p_value']:.3f} ({'match' if r['reward_curves_match'] else 'differ'} at α 0.01)"),
]


def sd_ratio(r: dict, arm: str) -> float:
    return r["rollout_tok_s"][f"{arm}_sd"] / r["rollout_tok_s"][f"{arm}_plain"]


def recipe_table(runs: dict, corner: str, spec: list, prefix: str) -> str:
    """One column per result file (headed by its recipe, linked), one row per (label, cell) of `spec`."""
    head = f"| {corner} | " + " | ".join(f"[`{recipe(r)}`]({prefix}/{n}.json)" for n, r in runs.items()) + " |"
    rows = [head, "|---|" + "---|" * len(runs)]
    rows += [f"| {label} | " + " | ".join(cell(r) for r in runs.values()) + " |" for label, cell in spec]
    return "\n".join(rows)


def precision_block(results: dict, prefix: str) -> str:
    runs = {n: r for n, r in results.items() if suite(r) == "precision"}
    if not runs:
        return f"fp32 against bf16-mixed: {NOT_MEASURED}."
    steps = ", ".join(f"`{recipe(r)}` {r['steps']} steps" for r in runs.values())
    return recipe_table(runs, "fp32 → bf16-mixed", PRECISION_ROWS, prefix) + \
        f"\n\nMeans over steps 1..N-1 ({steps}); machines and commands in the index above."


def parity_block(results: dict, prefix: str) -> str:
    """bench/precision_parity.py: does bf16-mixed learn as fp32 does, over several seeds."""
    runs = {n: r for n, r in results.items() if suite(r) == "precision_parity"}
    if not runs:
        return f"Learning parity of bf16-mixed over several seeds: {NOT_MEASURED}."
    rows = ["| recipe | seeds × steps | reward mean fp32 / bf16 | reward curves (paired test) | held-out accuracy "
            "before → after, fp32 / bf16 | accuracy after (paired test) |", "|---|---|---|---|---|---|"]
    for n, r in runs.items():
        rows.append(f"| [`{recipe(r)}`]({prefix}/{n}.json) | {len(r['seeds'])} × {r['steps']} | "
                    f"{r['reward_mean_fp32']:.3f} / {r['reward_mean_bf16']:.3f} | p = {r['parity_p_value']:.3f} | "
                    f"{r['accuracy_before_fp32']:.2f} → {r['accuracy_after_fp32']:.2f} / "
                    f"{r['accuracy_before_bf16']:.2f} → {r['accuracy_after_bf16']:.2f} | "
                    f"p = {r['accuracy_after_p_value']:.3f} |")
    return "\n".join(rows)


def precision_rows(results: dict, prefix: str) -> list[str]:
    """The status rows of bench/precision.py results."""
    rows = []
    for n, r in results.items():
        if suite(r) != "precision":
            continue
        link, where = f"[{n}.json]({prefix}/{n}.json)", f"`{recipe(r)}`"
        rows.append(f"| bf16-mixed vs fp32, whole RL step | **{x(r['step_speedup'])}** faster, reward curves "
                    f"p = {r['parity_p_value']:.3f} | {where} | {r['machine']} | {link} |")
        rows.append(f"| SD vs plain decoding, rollout tokens/s at the recipe's batch | {x(sd_ratio(r, 'fp32'))} "
                    f"(fp32), {x(sd_ratio(r, 'bf16'))} (bf16) | {where} | {r['machine']} | {link} |")
        rows.append(f"| held-out accept length after warm-start (fixed chain, greedy, fp32) | {r['accept_len_fp32']:.2f} "
                    f"tokens per target pass | {where} | {r['machine']} | {link} |")
    return rows


def status_block(results: dict, prefix: str) -> str:
    """The README's status at a glance: what pays where, on which hardware, with links to the files."""
    rows = ["| question | answer | recipe | hardware | source |", "|---|---|---|---|---|"] + precision_rows(results, prefix)
    for n, r in results.items():
        if suite(r) != "rl_step":
            continue
        link, where = f"[{n}.json]({prefix}/{n}.json)", f"`{recipe(r)}`"
        if r.get("mode") == "paired":
            rows.append(f"| tail SD + bandit rollout vs plain / SD always on / best static table, paired on the "
                        f"same weights and prompts ({engine_of(r)}) | **{x(r['paired_adaptive_vs_plain'])}** / "
                        f"{x(r['paired_adaptive_vs_always'])} / {x(r['paired_adaptive_vs_static'])} | {where} | "
                        f"{r['machine']} | {link} |")
            continue
        rows.append(f"| SD in the whole RL step, frozen / spot-trained drafter vs plain (torch engine) | "
                    f"{x(r['speedup_frozen_vs_plain'])} / {x(r['speedup_vs_plain'])} | {where} | {r['machine']} | {link} |")
        if r.get("speedup_vllm_vs_torch_plain"):
            rows.append(f"| vLLM backend, best RL step vs the torch engine's plain step | "
                        f"{x(r['speedup_vllm_vs_torch_plain'])} | {where} | {r['machine']} | {link} |")
        if r.get("step_s_trl"):
            rows.append(f"| best tlt RL step vs TRL's GRPOTrainer, same precision | **{x(r['speedup_vs_trl'])}** "
                        f"faster | {where} | {r['machine']} | {link} |")
    for n, r in results.items():
        link, where = f"[{n}.json]({prefix}/{n}.json)", f"`{recipe(r)}`"
        if suite(r) == "rollout":
            curve = " / ".join(x(w["speedup_vs_plain"]) for w in r["rows"])
            batches = " / ".join(str(w["batch"]) for w in r["rows"])
            rows.append(f"| SD vs plain decoding at batch {batches} ({r.get('rollout_dtype', 'float32')} rollout) | "
                        f"{curve}, greedy identical: {r['greedy_identical']} | {where} | {r['machine']} | {link} |")
        elif suite(r) == "vllm_rollout" and r.get("k0_tax"):
            rows.append(f"| vLLM engine built with SD, decoding with SD off, vs one built without SD (the K = 0 tax) | "
                        f"{x(1 / r['k0_tax'])} of plain | {where} | {r['machine']} | {link} |")
        elif suite(r) == "served":
            rows.append(f"| a run's model folder served by vLLM's OpenAI server (CPU build, {r['precision']}): served "
                        f"accept length vs tlt's on the same requests | {r['served_accept_len']:.2f} vs "
                        f"{r['tlt_accept_len_same_requests']:.2f} tokens per verify (K = {r['num_speculative_tokens']}), "
                        f"greedy completions identical {r['greedy_identical_share']:.0%} | {where} | {r['machine']} | "
                        f"{link} |")
        elif suite(r) == "adaptive" and "payoff_accept_ratio" in r:
            rows.append(f"| `payoff` drafter schedule vs refreshing every step | held-out accept length "
                        f"{x(r['payoff_accept_ratio'])} at {r['payoff_drafter_time_ratio']:.0%} of the drafter time | "
                        f"{where} | {r['machine']} | {link} |")
    rows.append(f"| GPU rollout and training speed | {NOT_MEASURED} | | GPU | [GPU guide](docs/gpu.md) |")
    return "\n".join(rows)


RL_STEP_ROWS = [  # (label, cell from one rl_step result)
    ("RL step, torch engine: plain / SD + spot trainer / SD + frozen drafter",
     lambda r: f"{r['step_s_plain']:.1f} / {r['step_s_spec']:.1f} / {r['step_s_frozen']:.1f} s "
               f"({x(r['speedup_vs_plain'])} / {x(r['speedup_frozen_vs_plain'])} vs plain)"),
    ("rollout in the step, SD + spot / SD + frozen vs plain",
     lambda r: f"{x(r['rollout_speedup'])} / {x(r['rollout_speedup_frozen'])}"),
    ("RL step, vLLM backend: plain / tail SD + spot / tail SD + frozen",
     lambda r: f"{r['step_s_vllm_plain']:.1f} / {r['step_s_vllm_spec']:.1f} / {r['step_s_vllm_frozen']:.1f} s, "
               f"{r['vllm_rebuilds']:.0f} rebuilds" if r.get("step_s_vllm_plain") else NOT_MEASURED),
    ("best vLLM step vs torch plain / vs best torch step",
     lambda r: f"{x(r['speedup_vllm_vs_torch_plain'])} / {x(r['speedup_vllm_vs_torch'])}"
     if r.get("speedup_vllm_vs_torch") else NOT_MEASURED),
    ("RL step, SD + spot vs SD always on / vs the best static schedule (torch; vLLM)",
     lambda r: f"{x(r['speedup_vs_always'])} / {x(r['speedup_vs_static'])}"
               + (f"; {x(r['speedup_vllm_vs_always'])} / {x(r['speedup_vllm_vs_static'])}"
                  if r.get("speedup_vllm_vs_static") else "") if r.get("speedup_vs_static") else NOT_MEASURED),
    ("bandit regret after the last step, SD + spot arm", lambda r: f"{r['regret']['adaptive']:.2f} s"
     if (r.get("regret") or {}).get("adaptive") is not None else NOT_MEASURED),
    ("TRL GRPOTrainer step (same precision) / best tlt step",
     lambda r: f"{r['step_s_trl']:.1f} s, tlt {x(r['speedup_vs_trl'])} faster" if r.get("step_s_trl") else NOT_MEASURED),
    ("greedy held-out eval identical with SD on and off: torch / vLLM",
     lambda r: f"{r['greedy_eval_identical']} / {r.get('vllm_greedy_eval_identical', '–')}"),
    ("reward curves SD + spot vs plain, paired permutation test", lambda r: f"p = {r['parity_p_value']:.3f}"),
]


def rl_step_block(results: dict, prefix: str) -> str:
    """bench/rl_step.py: whole RL steps per arm, the vLLM arms and TRL's GRPOTrainer."""
    runs = {n: r for n, r in results.items() if suite(r) == "rl_step" and r.get("mode") != "paired"}
    if not runs:
        return f"Whole RL steps: {NOT_MEASURED}."
    return recipe_table(runs, "arm", RL_STEP_ROWS, prefix) + \
        "\n\nMeans over steps 1..N-1; machines and commands in the index above."


def threshold_text(t) -> str:
    """A tail threshold as the run decoded with it (`auto`: priced; 1 << 20: no bound)."""
    return "—" if t is None else "none (SD off)" if t == 0 else "every batch" if t >= 1 << 20 else f"≤ {t}"


def paired_block(results: dict, prefix: str) -> str:
    """bench/rl_step.py --paired: per arm, the paired rollout ratio plain / arm with its 95 % interval; the
    adaptive arm's priced start (acceptance, tail threshold), its token ratio and the bandit's regret."""
    runs = {n: r for n, r in results.items() if suite(r) == "rl_step" and r.get("mode") == "paired"}
    if not runs:
        return f"Paired mode: {NOT_MEASURED}."
    out = ["| recipe | steps | " + " | ".join(f"plain / {a} (rollout)" for a in ("always", "static", "adaptive"))
           + " | plain / adaptive (s per token) | adaptive: priced at / tail threshold | bandit regret |",
           "|---|---|---|---|---|---|---|---|"]
    for n, r in runs.items():
        cells = []
        for c in [r["paired_rollout_ratio"][a] for a in ("always", "static", "adaptive")] + \
                 [r["paired_token_ratio"]["adaptive"]]:
            ci = f" (95 % CI {c['ci_low']:.2f}–{c['ci_high']:.2f})" if c["ci_low"] is not None else ""
            cells.append(f"{x(c['mean'])}{ci}")
        priced = r.get("paired_priced") or {}
        rate = priced.get("prior_accept_rate")
        cells.append(f"{'—' if rate is None else f'{rate:.2f} / draft'} / {threshold_text(priced.get('tail_threshold'))}")
        regret = r.get("paired_regret_s")
        cells.append("—" if regret is None else f"{regret:.1f} s")
        out.append(f"| [`{recipe(r)}`]({prefix}/{n}.json), {engine_of(r)} | {r['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def rollout_block(results: dict, prefix: str) -> str:
    """bench/rollout.py: the engine's cost curve, plain against SD per batch size, greedy."""
    runs = {n: r for n, r in results.items() if suite(r) == "rollout"}
    if not runs:
        return f"Rollout cost curve: {NOT_MEASURED}."
    out = []
    for n, r in runs.items():
        drafter = {"ngram": "n-gram drafter", "warmstart": "the recipe's warm-started EAGLE-3 drafter (`--drafter "
                   "warmstart`)"}.get(r["drafter"], "EAGLE-3 export drafter")
        out += [f"[`{recipe(r)}`]({prefix}/{n}.json): {drafter}, {r['prompts']} prompts, "
                f"{r['max_new_tokens']} new tokens, rollout dtype {r.get('rollout_dtype', 'float32')}, "
                f"{r['threads']} threads:", "",
                "| batch | plain tok/s | SD tok/s | SD / plain | live accept length | HF generate tok/s |",
                "|---|---|---|---|---|---|"]
        out += [f"| {w['batch']} | {w['plain_tok_s']:.1f} | {w['spec_tok_s']:.1f} | **{x(w['speedup_vs_plain'])}** | "
                f"{w['accept_len_mean']:.2f} | {w['hf_tok_s']:.1f} |" for w in r["rows"]]
        out += ["", f"Greedy outputs identical with SD on and off: {r['greedy_identical']}. Held-out accept length "
                f"(`{r['accept_strategy']}`, tuner off): greedy {r['accept_len_greedy']:.2f}, sampled "
                f"{r['accept_len_sampled']:.2f}."]
        if "grpo" in r:
            g = r["grpo"]
            out.append(f"GRPO batch at the rollout temperature (tail switch as configured): plain {g['plain_s']:.2f} s, "
                       f"SD {g['spec_s']:.2f} s ({x(g['speedup'])}), tail share {g['tail_share']:.2f}."
                       + (f" Against the baselines on the same batch: SD always on {r['rollout_s_always']:.2f} s "
                          f"(tail SD {x(r['speedup_vs_always'])} faster), best static draft length per tier "
                          f"{r['rollout_s_static']:.2f} s ({x(r['speedup_vs_static'])})."
                          if r.get("rollout_s_static") else ""))
    return "\n".join(out)


def schedules_block(results: dict, prefix: str) -> str:
    """bench/adaptive.py --schedules: drafter refresh schedules, accept length against drafter time."""
    runs = {n: r for n, r in results.items() if suite(r) == "adaptive" and "arms" in r}
    if not runs:
        return f"Refresh schedules: {NOT_MEASURED}."
    out = []
    for n, r in runs.items():
        out += [f"[`{recipe(r)}`]({prefix}/{n}.json), {r['steps']} RL steps per arm, interleaved:", "",
                "| schedule | RL step s | rollout s | drafter steps | drafter s | held-out accept length (fixed chain, "
                "greedy), after warm-start → after the last step |", "|---|---|---|---|---|---|"]
        for a, m in r["arms"].items():
            acc = r[f"accept_len_{a}"]
            out.append(f"| `{a}` | {m['step_s']:.1f} | {m['rollout_s']:.1f} | {r[f'drafter_steps_{a}']:.0f} | "
                       f"{r[f'drafter_s_{a}']:.1f} | {acc[0]:.2f} → {acc[-1]:.2f} |")
        if "payoff_accept_ratio" in r:
            out += ["", f"payoff against every_k: held-out accept length {x(r['payoff_accept_ratio'])} (mean after the steps) "
                    f"at {r['payoff_drafter_time_ratio']:.0%} of the drafter time."]
    return "\n".join(out)


def drift_block(results: dict, prefix: str) -> str:
    """bench/adaptive.py (drift): held-out accept length of frozen, adaptive and control drafters per RL step."""
    runs = {n: r for n, r in results.items() if suite(r) == "adaptive" and "accept_adaptive" in r}
    if not runs:
        return f"The drafter under drift: {NOT_MEASURED}."
    out = []
    for n, r in runs.items():
        out += [f"[`{recipe(r)}`]({prefix}/{n}.json), rl.lr {r['rl_lr']:g}, {r['drafter_steps_per_rl_step']:.0f} "
                "drafter steps per RL step:", "",
                "| after RL step | greedy tokens changed | KL(π_t ‖ π_0) | frozen | adaptive | control |",
                "|---|---|---|---|---|---|"]
        out += [f"| {t} | {r['drift_token_share'][t]:.2f} | {r['kl'][t]:.3f} | {r['accept_frozen'][t]:.2f} | "
                f"**{r['accept_adaptive'][t]:.2f}** | {r['accept_control'][t]:.2f} |" for t in range(len(r["kl"]))]
        lo, hi = r["gain_vs_frozen_ci"]
        out += ["", f"Adaptive over frozen after the last step: {x(r['gain_vs_frozen'])} (95 % CI {lo:.2f}–{hi:.2f}); "
                f"over control (the same refresher on the warm-start corpus): {x(r['gain_vs_control'])}."]
    return "\n".join(out)


def vllm_block(results: dict, prefix: str) -> str:
    """bench/vllm_rollout.py: the tail arm over plain / always / static on each engine, same prompts, and the
    K = 0 tax (the SD-built vLLM engine with SD off against an engine built without SD)."""
    runs = {n: r for n, r in results.items() if suite(r) == "vllm_rollout"}
    if not runs:
        return f"vLLM rollout arms and the K = 0 tax: {NOT_MEASURED}."
    out = ["| recipe | engine | tail threshold | tail SD vs plain / always / static | greedy identical | K = 0 tax |",
           "|---|---|---|---|---|---|"]
    for n, r in runs.items():
        tax = r.get("k0_tax")
        for eng in ("vllm", "torch"):
            vs = [r[f"rollout_s_{eng}_{b}"] / r[f"rollout_s_{eng}_tail"] for b in ("plain", "always", "static")]
            cell = (f"{r['rollout_s_vllm_k0']:.2f} s vs {r['rollout_s_vllm_plain_engine']:.2f} s: "
                    f"{x(1 / tax)} of plain" if eng == "vllm" and tax else "—")
            out.append(f"| [`{recipe(r)}`]({prefix}/{n}.json) | {'vLLM' if eng == 'vllm' else 'torch engine'} | "
                       f"{threshold_text(r.get('spec_threshold'))} | " + " / ".join(x(v) for v in vs)
                       + f" | {'yes' if r.get('greedy_identical') else 'no'} | {cell} |")
    return "\n".join(out)


BLOCKS = {"index": index_block, "vllm": vllm_block, "precision": precision_block, "parity": parity_block, "rl_step": rl_step_block,
          "paired": paired_block,
          "rollout": rollout_block, "schedules": schedules_block, "drift": drift_block, "status": status_block}


# ---------------------------------------------------------------- pages
def render_page(text: str, results: dict, prefix: str) -> str:
    """`text` with every generated block it contains re-rendered."""
    for name, block in BLOCKS.items():
        start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
        if start in text:
            head, rest = text.split(start, 1)
            text = f"{head}{start}\n{block(results, prefix)}\n{end}{rest.split(end, 1)[1]}"
    return text


def stale(results: dict | None = None) -> dict[str, str]:
    """page -> its rendered text, for every page whose generated blocks are out of date."""
    results = load_results() if results is None else results
    out = {}
    for page, prefix in PAGES.items():
        text = (ROOT / page).read_text()
        new = render_page(text, results, prefix)
        if new != text:
            out[page] = new
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is out of date; write nothing")
    args = ap.parse_args(argv)
    pages = stale()
    if args.check:
        for page in pages:
            print(f"{page}: generated results blocks are stale; run `python bench/render.py`", file=sys.stderr)
        return 1 if pages else 0
    for page, text in pages.items():
        (ROOT / page).write_text(text)
        print(f"rendered {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
