"""A run's model folder served by stock vLLM (the CPU build's OpenAI-compatible server, started with
the command the folder's README prints), measured as a deployment sees it: the served accept
length on the config's held-out prompts (1 + accepted / drafts, the server's own counters) beside
tlt's figure for the same folder (`tlt-model.json`, measured by the export stage on the reloaded
folder), and the share of greedy completions identical to tlt's torch engine on that folder.

    make run && python bench/served.py conf/default.yaml --json out.json [--folder runs/<id>/model]

Without --folder: the newest model folder under the config's `trainer.checkpoint_dir` (the last run).
"""
import json
import tempfile
from pathlib import Path

import harness
from tlt.errors import UserError

vs = harness.load("vllm_server")
FLAGS = (("--folder", None, "a model folder (policy/, drafter/, README.md); default: the newest run's"),
         ("--kv-cache-mib", 512, "the server's KV cache (MiB)"))


def newest_folder(cfg) -> Path:
    found = sorted(Path(cfg.trainer.checkpoint_dir).glob("*/model/tlt-model.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UserError(f"no model folder under {cfg.trainer.checkpoint_dir}/*/model: run `make run` first, or pass "
                        "--folder")
    return found[-1].parent


def tolerance(n_prompts: int, drafts: float, k: int) -> float:
    """|served - tlt| allowed: vLLM counts each request's last round also past max_tokens / EOS (up to k
    tokens and one verify per request) and differing kernels may flip near-tied drafts (allow two)."""
    return (n_prompts + 2) * k / max(drafts, 1)


def torch_side(folder: Path, cfg, prompts: list[list[int]], max_new: int, dtype: str, k: int) -> tuple:
    """(greedy completions without EOS, the EOS ids, tlt's accept report one request at a time with
    the server's chain depth `k`) of the reloaded folder in tlt's torch engine, in the export's precision."""
    from tlt.config import SpecStrategy
    from tlt.model_folder import load_model_folder
    from tlt.models import eos_token_ids
    from tlt.rollout import RolloutEngine
    from tlt.rollout.acceptance import measure_accept

    model, tok, drafter = load_model_folder(folder)
    engine = RolloutEngine(model, cfg.rollout.model_copy(update={"dtype": dtype, "tuner": False}),
                           eos_token_ids(tok, model), tok.pad_token_id or 0, drafter=drafter)
    out = [engine.generate([p], max_new_tokens=max_new, temperature=0.0, spec=False).response_ids[0] for p in prompts]
    report = measure_accept(engine, prompts, 0.0, max_new, SpecStrategy(depth=k, topk=1, tokens=k), batch_size=1)
    return [[int(t) for t in ids if t not in engine.eos_ids] for ids in out], engine.eos_ids, report


def _shown(folder: Path) -> str:
    """The folder as the result names it: relative to the working directory (no machine paths)."""
    try:
        return str(folder.relative_to(Path.cwd()))
    except ValueError:
        return folder.name


def measure(cfg, folder: Path, kv_cache_mib: int) -> dict:
    from tlt.models import load_tokenizer

    figures = json.loads((folder / "tlt-model.json").read_text())
    k = vs.serve_args(folder)[1]["num_speculative_tokens"]
    prompts = harness.heldout_prompts(cfg, load_tokenizer(cfg.model))[: cfg.drafter.warmstart_eval_prompts]
    max_new = cfg.drafter.eval_max_new_tokens
    extra = ["--dtype", figures["precision"], "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4",
             "--kv-cache-memory-bytes", str(kv_cache_mib * 2**20), "--seed", "0"]
    with tempfile.TemporaryDirectory(prefix="tlt-served-") as tmp, \
            vs.serving(folder, extra, Path(tmp) / "vllm-server.log") as server:
        served = vs.query(server, prompts, max_new)
        drafts, accepted = vs.spec_counters(server)
    ours, eos, report = torch_side(folder, cfg, prompts, max_new, figures["precision"], k)
    same = sum(a == [t for t in s["token_ids"] if t not in eos] for a, s in zip(ours, served))
    served_len = 1 + accepted / max(drafts, 1)
    return {"folder": _shown(folder), "run_id": figures.get("run_id"), "precision": figures["precision"],
            "num_speculative_tokens": k, "prompts": len(prompts), "max_tokens": max_new,
            "drafts": drafts, "accepted": accepted, "served_accept_len": served_len,
            "served_tokens": sum(len(x["token_ids"]) for x in served), "tlt_tokens": sum(map(len, ours)),
            "tlt_accept_len_same_requests": report.accept_len, "tlt_passes_same_requests": report.passes,
            "tlt_accept_len": figures.get("accept_len"), "tlt_accept_strategy": figures.get("draft_strategy"),
            "tolerance": tolerance(len(prompts), drafts, k),
            "served_minus_tlt": served_len - figures["accept_len"] if figures.get("accept_len") else None,
            "greedy_identical_share": same / len(prompts)}


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, *FLAGS, config="conf/default.yaml"), argv)
    cfg = harness.config(args)
    folder = (Path(args.folder) if args.folder else newest_folder(cfg)).resolve()
    if not (folder / "tlt-model.json").is_file() or not (folder / "drafter").is_dir():
        raise UserError(f"--folder {folder}: not a tlt model folder with a drafter (tlt-model.json, drafter/); pass "
                        "the folder a run's export stage or `tlt export --out` wrote")
    if not vs.VLLM_PY.exists():
        raise UserError(f"no vLLM interpreter at {vs.VLLM_PY}: build it with `bash bench/vllm_venv.sh`")
    return harness.write_result(measure(cfg, folder, args.kv_cache_mib), "served", args, argv)


if __name__ == "__main__":
    main()
