"""TRL peer of bench/rl_step.py: `GRPOTrainer` on the same model, prompts and GRPO settings.

    .venv-trl/bin/python bench/trl_grpo.py ARGS.json      (written by bench/rl_step.py)

Runs inside `.venv-trl` (TRL and its own transformers), so it imports nothing from tlt. CPU,
at tlt's training precision (`bf16`: fp32 weights with the Trainer's bf16 autocast, as tlt's
bf16-mixed; else fp32), transformers `generate` (no vLLM), prompts already chat-templated by tlt (`render_prompt`)
and fed in tlt's sampler order (`shuffle_dataset=False`), one optimizer step = prompts x G
completions. Reward: exact match of the last number of the completion with the answer (inline,
a stand-in for tlt's reasoning-gym scorer on these one-number answers). Writes per-step
wall-clock (a TrainerCallback: on_train_begin -> each on_step_end) and the logged rewards.
"""
from __future__ import annotations

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
        self.t, self.step_s, self.logs = 0.0, [], []

    def on_train_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.step_s.append(now - self.t)
        self.t = now
        print(f"trl step {len(self.step_s) - 1}: {self.step_s[-1]:.1f} s", flush=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.logs.append(dict(logs))


def main(path: str) -> None:
    a = json.loads(open(path).read())
    torch.manual_seed(a["seed"])
    tok = AutoTokenizer.from_pretrained(a["model_dir"])
    if tok.pad_token is None or tok.pad_token == tok.eos_token:  # as tlt.models: pad distinct from eos
        tok.pad_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32)
    data = load_dataset("json", data_files=a["prompts"], split="train")
    cfg = GRPOConfig(
        output_dir=a["output_dir"], max_steps=a["steps"], learning_rate=a["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=a["weight_decay"], max_grad_norm=a["max_grad_norm"],
        per_device_train_batch_size=a["per_device_train_batch_size"],
        gradient_accumulation_steps=a["gradient_accumulation_steps"], num_generations=a["num_generations"],
        max_completion_length=a["max_completion_length"], temperature=a["temperature"], top_p=a["top_p"], top_k=0,
        beta=a["beta"], epsilon=a["epsilon"], epsilon_high=a["epsilon_high"], loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False, use_vllm=False, use_cpu=True, bf16=bool(a.get("bf16", False)),
        fp16=False, seed=a["seed"], logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)  # TRL defaults it on; tlt does not recompute activations
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=last_number_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    steps = timer.step_s
    out = {"step_s": sum(steps[1:]) / max(1, len(steps) - 1) if len(steps) > 1 else steps[0],
           "step_s_all": steps, "excluded": "step 0" if len(steps) > 1 else "nothing",
           "train_s": time.perf_counter() - t0,
           "reward_mean": [float(log["reward"]) for log in timer.logs],
           "completion_length_mean": [float(log.get("completions/mean_length", float("nan"))) for log in timer.logs],
           "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                        "torch": torch.__version__},
           "threads": torch.get_num_threads(), "bf16": bool(a.get("bf16", False)),
           "reward": "exact match of the last number (inline)"}
    open(a["out_json"], "w").write(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
