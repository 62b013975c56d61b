"""An exported drafter in vLLM's CPU build: mean acceptance length on the recipe's held-out prompts.

    python bench/vllm_accept.py conf/default.yaml --drafter DIR [--json OUT] [--k 3] [--max-tokens 32]
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from tlt.models import BUNDLED, bundled_smollm2_dir, load_tokenizer


def summarize(result: dict) -> dict:
    """vLLM's counters -> accept length, per-position acceptance, and the greedy check."""
    m, k, n = result["metrics"], result["k"], result["max_tokens"]
    drafts = max(m["vllm:spec_decode_num_drafts"], 1)
    same = [s == b[:len(s)] and (len(s) == n or len(s) == len(b)) for s, b in zip(result["spec"], result["baseline"])]
    return {"accept_len": 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts,
            "num_drafts": m["vllm:spec_decode_num_drafts"],
            "accepted_tokens": m["vllm:spec_decode_num_accepted_tokens"],
            "accept_rate_per_pos": [a / drafts for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]],
            "greedy_identical": all(same), "mismatches": same.count(False), "prompts": len(same), "k": k,
            "max_tokens": n, "response_tokens": sum(len(s) for s in result["spec"]),
            "timing_s": result["timing_s"], "versions": result["versions"]}


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, ("--prompts", None, "N held-out prompts (default: all)", int),
                        ("--k", 3, "num_speculative_tokens"), ("--max-tokens", 32, None),
                        ("--ignore-eos", False, "fixed-length decoding past EOS (default: stop at EOS)"),
                        ("--vllm-python", str(harness.ROOT / ".venv-vllm" / "bin" / "python"), None))
    ap.add_argument("--drafter", required=True, help="EAGLE-3 export directory (tlt drafter warmstart --export)")
    args = harness.parse(ap, argv)
    if not Path(args.vllm_python).exists():
        sys.exit(f"vllm_accept: no vLLM venv at {args.vllm_python}; build it with `bash bench/vllm_venv.sh`")
    cfg = harness.config(args)
    target = Path(cfg.model.name_or_path).expanduser()  # a local HF folder vLLM can load
    if cfg.model.name_or_path == BUNDLED:
        target = bundled_smollm2_dir(cfg.model.cache_dir)  # the bundled model's converted cache folder
    elif not (target / "config.json").is_file():
        sys.exit(f"vllm_accept: model.name_or_path must be {BUNDLED} or a local HF folder, not {target}")
    prompts = harness.heldout_prompts(cfg, load_tokenizer(cfg.model), args.prompts)
    with tempfile.TemporaryDirectory(prefix="vllm_accept-") as tmp:  # vLLM cannot load into tlt's venv
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        cmd = [args.vllm_python, str(harness.ROOT / "tlt" / "vllm_check.py"), str(target),
               str(Path(args.drafter).resolve()), str(Path(tmp) / "prompts.json"), "--k", str(args.k),
               "--max-tokens", str(args.max_tokens), "--out", str(Path(tmp) / "result.json"),
               *([] if args.ignore_eos else ["--stop-at-eos"])]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"vllm_accept: vllm_check.py failed (rc {proc.returncode}); log tail:\n{proc.stdout[-4000:]}")
        res = summarize(json.loads((Path(tmp) / "result.json").read_text()))
    res.update(config=args.config, drafter=str(args.drafter), ignore_eos=args.ignore_eos)
    return harness.write_result(res, "vllm_accept", args, argv)


if __name__ == "__main__":
    main()
