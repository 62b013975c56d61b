"""An exported drafter in vLLM's CPU build: mean acceptance length on the recipe's held-out prompts.

    python bench/vllm_accept.py conf/default.yaml --drafter DIR [--json OUT] [--k 3] [--max-tokens 32]

Renders the config's held-out task prompts as the pipeline does (chat template + `data.instruction`),
then runs tlt/vllm_check.py under the vLLM venv (`bash bench/vllm_venv.sh` builds .venv-vllm):
the target with the EAGLE-3 drafter (`num_speculative_tokens` = k) and the target alone, both greedy.
Reports vLLM's own counters as `accept_len` = 1 + accepted_tokens / num_drafts (tokens per verify),
the acceptance rate per draft position, and `greedy_identical` (every speculative output equals the
plain one). By default generation stops at EOS, as in serving; `--ignore-eos` decodes a fixed
length instead (the tokens after EOS are text the drafter never trained on).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from tlt.config import load_config
from tlt.data import load_dataset, prompt_ids
from tlt.models import BUNDLED, bundled_smollm2_dir, load_tokenizer

ROOT = harness.ROOT
CHECK = ROOT / "tlt" / "vllm_check.py"


def target_dir(cfg) -> Path:
    """The target as a local HF folder vLLM can load (the bundled model's converted cache folder)."""
    if cfg.model.name_or_path == BUNDLED:
        return bundled_smollm2_dir(cfg.model.cache_dir)
    path = Path(cfg.model.name_or_path).expanduser()
    if not (path / "config.json").is_file():
        sys.exit(f"vllm_accept: model.name_or_path must be {BUNDLED} or a local HF folder, not {path}")
    return path


def heldout_prompts(cfg, n: int | None) -> list[list[int]]:
    """The held-out split's prompts (all, or the first n), token ids as the pipeline renders them."""
    tok = load_tokenizer(cfg.model)
    held = load_dataset(cfg.data, tok).heldout["prompt"].tolist()
    held = held[:n] if n else held
    return [prompt_ids(tok, p, cfg.data.instruction, cfg.data.system_prompt) for p in held]


def summarize(result: dict) -> dict:
    """vLLM's counters -> accept length, per-position acceptance, and the greedy check."""
    m, k, n = result["metrics"], result["k"], result["max_tokens"]
    drafts = m["vllm:spec_decode_num_drafts"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    same = [s == b[:len(s)] and (len(s) == n or len(s) == len(b)) for s, b in zip(result["spec"], result["baseline"])]
    return {"accept_len": 1 + accepted / max(drafts, 1), "num_drafts": drafts, "accepted_tokens": accepted,
            "accept_rate_per_pos": [a / max(drafts, 1) for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]],
            "greedy_identical": all(same), "mismatches": same.count(False), "prompts": len(same), "k": k,
            "max_tokens": n, "response_tokens": sum(len(s) for s in result["spec"]),
            "timing_s": result["timing_s"], "versions": result["versions"]}


def run_check(vllm_py: Path, target: Path, drafter: Path, prompts: list[list[int]], args) -> dict:
    """tlt/vllm_check.py in the vLLM venv (its own process: vLLM cannot load into tlt's venv)."""
    with tempfile.TemporaryDirectory(prefix="vllm_accept-") as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        out = Path(tmp) / "result.json"
        cmd = [str(vllm_py), str(CHECK), str(target), str(drafter), str(Path(tmp) / "prompts.json"),
               "--k", str(args.k), "--max-tokens", str(args.max_tokens), "--out", str(out),
               *([] if args.ignore_eos else ["--stop-at-eos"])]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"vllm_accept: vllm_check.py failed (rc {proc.returncode}); log tail:\n{proc.stdout[-4000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--drafter", required=True, help="EAGLE-3 export directory (tlt drafter warmstart --export)")
    ap.add_argument("--prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true", help="fixed-length decoding past EOS")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = ap.parse_args(argv)
    if not Path(args.vllm_python).exists():
        sys.exit(f"vllm_accept: no vLLM venv at {args.vllm_python}; build it with `bash bench/vllm_venv.sh`")
    cfg = load_config(args.config, args.overrides)
    prompts = heldout_prompts(cfg, args.prompts)
    summary = summarize(run_check(Path(args.vllm_python), target_dir(cfg), Path(args.drafter).resolve(), prompts, args))
    summary.update(config=args.config, drafter=str(args.drafter), ignore_eos=args.ignore_eos)
    print(f"vLLM {summary['versions']['vllm']}: {summary['prompts']} held-out prompts, k={args.k}, "
          f"{summary['response_tokens']} tokens: accept length {summary['accept_len']:.2f} "
          f"(per position {', '.join(f'{r:.2f}' for r in summary['accept_rate_per_pos'])}), "
          f"greedy identical: {'yes' if summary['greedy_identical'] else 'NO'}")
    return harness.write_result(summary, "vllm_accept", args, argv)


if __name__ == "__main__":
    main()
