"""TRL peer of bench/rl_step.py: `GRPOTrainer` on the same model, prompts and GRPO settings.

    .venv-trl/bin/python bench/trl_grpo.py ARGS.json      (written by bench/rl_step.py)

Runs inside `.venv-trl` (imports nothing from tlt), on the CPU at tlt's training precision; reward:
the completion's last number equals the answer. Writes per-step wall-clock and the logged rewards.
"""
import json
import re
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the last number in the completion equals the answer's number, else 0.0."""
    out = []
    for text, gold in zip(completions, answer):
        nums = _NUMBER.findall(text.replace(",", ""))
        try:
            out.append(float(bool(nums) and float(nums[-1]) == float(gold)))
        except ValueError:
            out.append(0.0)
    return out


class StepTimer(TrainerCallback):
    """Wall-clock of each optimizer step (generation, reward, forward/backward, AdamW)."""

    def __init__(self):
        self.t, self.step_s = time.perf_counter(), []

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.step_s.append(now - self.t)
        self.t = now
        print(f"trl step {len(self.step_s) - 1}: {self.step_s[-1]:.1f} s", flush=True)


def main(path: str) -> None:
    a = json.loads(open(path).read())
    g = a["grpo"]  # GRPOConfig's own keys, set by bench/rl_step.py from tlt's config
    torch.manual_seed(g["seed"])
    tok = AutoTokenizer.from_pretrained(a["model_dir"])
    if tok.pad_token is None or tok.pad_token == tok.eos_token:  # as tlt.models: pad distinct from eos
        tok.pad_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32)
    cfg = GRPOConfig(**g, lr_scheduler_type="constant", warmup_steps=0, top_k=0, loss_type="dapo",
                     scale_rewards="group", num_iterations=1, shuffle_dataset=False, use_vllm=False, use_cpu=True,
                     fp16=False, logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
                     disable_tqdm=True, gradient_checkpointing=False)  # TRL defaults it on; tlt does not recompute
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=last_number_reward, args=cfg, processing_class=tok,
                          train_dataset=load_dataset("json", data_files=a["prompts"], split="train"), callbacks=[timer])
    t0 = timer.t = time.perf_counter()
    trainer.train()
    steps, logs = timer.step_s, [log for log in trainer.state.log_history if "reward" in log]
    out = {"step_s": sum(steps[1:]) / (len(steps) - 1) if len(steps) > 1 else steps[0],
           "step_s_all": steps, "excluded": "step 0" if len(steps) > 1 else "nothing",
           "train_s": time.perf_counter() - t0, "reward_mean": [float(log["reward"]) for log in logs],
           "completion_length_mean": [float(log.get("completions/mean_length", float("nan"))) for log in logs],
           "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                        "torch": torch.__version__},
           "threads": torch.get_num_threads(), "bf16": g["bf16"], "reward": "exact match of the last number (inline)"}
    open(a["out_json"], "w").write(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
