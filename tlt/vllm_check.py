"""Run an EAGLE-3 export in vLLM (CPU build) and report greedy outputs and acceptance counters.

    .venv-vllm/bin/python tlt/vllm_check.py TARGET_DIR DRAFTER_DIR PROMPTS.json \
        --k 3 --max-tokens 32 --out result.json

This file runs under the vLLM venv (bench/vllm_venv.sh), which lacks tlt's dependencies: it
imports only vllm, torch and the stdlib, never the rest of tlt. It is a script, not a module of
the library (importing it from tlt's venv fails on `vllm`).

Two engines, one after the other (memory: each holds its own KV cache):
  1. the target with the drafter (`method: eagle3`, k draft tokens), greedy, `max_tokens`;
  2. the target alone, greedy, `max_tokens + k` tokens: vLLM counts drafts accepted past
     max_tokens, so a predictor that replays the counters needs the k tokens beyond the end.
Both run fp32 (bf16 and fp32 greedy outputs differ on random weights) with ignore_eos, or with
`--stop-at-eos` stop at EOS as in serving (bench/vllm_accept.py).
Output JSON: {"spec": [[ids]], "baseline": [[ids]] (null with --no-baseline), "metrics": {name: int | [int]},
"timing_s": {...}, "versions": {...}}; metrics are vLLM's `vllm:spec_decode_*` counters.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="target model folder (save_pretrained: config, safetensors, tokenizer)")
    ap.add_argument("drafter", help="EAGLE-3 export folder (tlt.drafter.eagle3.export_eagle3)")
    ap.add_argument("prompts", help="JSON file: a list of prompts, each a list of token ids")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated with speculation")
    ap.add_argument("--max-model-len", type=int, default=512, help="small: the KV cache is sized for it")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache memory per engine (CPU RAM)")
    ap.add_argument("--out", default="-", help="result JSON path ('-' = stdout)")
    ap.add_argument("--no-baseline", action="store_true", help="start only the engine with the drafter (the "
                    "caller compares with its own greedy reference: one engine start instead of two)")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop each request at EOS, as in serving "
                    "(default: fixed length, ignore_eos)")
    return ap.parse_args(argv)


def make_llm(args: argparse.Namespace, n_prompts: int, speculative: bool):
    """One small fp32 engine: eager (no torch.compile, ~20 s start), stats on for get_metrics()."""
    from vllm import LLM  # deferred: vllm is optional (its own venv) and slow to import

    spec = {"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.k} if speculative else None
    return LLM(model=args.target, dtype="float32", speculative_config=spec, disable_log_stats=False,
               enforce_eager=True, seed=0, max_model_len=args.max_model_len, max_num_seqs=max(1, n_prompts),
               max_num_batched_tokens=max(args.max_model_len, 256),
               kv_cache_memory_bytes=args.kv_cache_mib * 2**20)


def generate(llm, prompts: list[list[int]], max_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """Greedy, fixed length (ignore_eos) unless stop_at_eos, no detokenization (tiny vocabularies
    exceed the tokenizer)."""
    from vllm import SamplingParams, TokensPrompt  # deferred: vllm, as above

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not stop_at_eos, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def spec_metrics(llm) -> dict[str, int | list[int]]:
    """The spec-decode counters (Counter -> int, Vector -> list) summed over label sets."""
    found: dict[str, int | list[int]] = {}
    for m in llm.get_metrics():
        if m.name not in SPEC_METRICS:
            continue
        if hasattr(m, "values"):  # Vector: accepted tokens per draft position
            prev = found.get(m.name, [0] * len(m.values))
            found[m.name] = [int(a) + int(b) for a, b in zip(prev, m.values)]
        else:
            found[m.name] = int(found.get(m.name, 0)) + int(m.value)
    missing = [n for n in SPEC_METRICS if n not in found]
    if missing:
        raise RuntimeError(f"vLLM reported no {missing}; is disable_log_stats=False and speculation on?")
    return found


def _baseline(args: argparse.Namespace, prompts: list[list[int]], timing: dict) -> list[list[int]]:
    t0 = time.perf_counter()
    llm = make_llm(args, len(prompts), speculative=False)
    timing["start_baseline_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    baseline = generate(llm, prompts, args.max_tokens + args.k, args.stop_at_eos)
    timing["generate_baseline_s"] = time.perf_counter() - t0
    del llm
    gc.collect()
    return baseline


def run(args: argparse.Namespace) -> dict:
    import torch  # deferred: loaded only when the check runs, with vllm
    import vllm  # deferred: vllm, as above

    with open(args.prompts) as f:
        prompts = [[int(t) for t in p] for p in json.load(f)]
    timing = {}
    t0 = time.perf_counter()
    llm = make_llm(args, len(prompts), speculative=True)
    timing["start_spec_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec = generate(llm, prompts, args.max_tokens, args.stop_at_eos)
    timing["generate_spec_s"] = time.perf_counter() - t0
    metrics = spec_metrics(llm)
    # One engine at a time: shut the first down before the second allocates its cache.
    del llm
    gc.collect()
    baseline = None if args.no_baseline else _baseline(args, prompts, timing)
    return {"spec": spec, "baseline": baseline, "metrics": metrics, "k": args.k, "max_tokens": args.max_tokens,
            "timing_s": {k: round(v, 2) for k, v in timing.items()},
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never reach for the hub
    result = run(args)
    text = json.dumps(result)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":  # required: vLLM spawns its engine core, which re-imports __main__
    sys.exit(main())
