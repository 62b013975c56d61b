"""Run configuration models: one pydantic model per stage under `RunConfig`.

Defaults live here and only here (the cluster's and vLLM's hardware options: cluster.py). Every
model forbids unknown keys, so a typo in a YAML recipe or a `--set` override fails with the dotted
key and the nearest valid name.
`RunConfig` is also the Prefect flow parameter, so the UI renders it as a form.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator, model_validator

from tlt.config.base import Stage
from tlt.config.cluster import DEVICE_FIELD, ClusterConfig, TrainDevice, VllmConfig, placement_checks


class ModelConfig(Stage):
    name_or_path: str = Field(
        "bundled:smollm2-135m-instruct",
        description="Target policy: 'bundled:smollm2-135m-instruct', a local HF directory, "
        "a hub id (online only) or 'tiny:ARCH' (a random model for tests: tiny:llama, tiny:qwen2, tiny:qwen3, "
        "tiny:mistral, tiny:gemma3, tiny:phi3, tiny:olmo2, tiny:granite, tiny:qwen3_moe)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype the policy's weights are "
                                                             "stored (and updated) in: float32 = fp32 master "
                                                             "weights (what trainer.precision bf16-mixed needs)")
    tiny_layers: int = Field(4, ge=1, le=64, description="Layers of a tiny:* random model")
    tiny_hidden: int = Field(128, ge=64, description="Hidden size of a tiny:* model (head_dim stays 64)")
    tiny_vocab: int = Field(512, ge=64, description="Vocabulary of a tiny:* model")
    cache_dir: str = Field(".cache/models", description="Where converted models are kept")


class GeneratorSpec(Stage):
    task: str = Field(..., description="reasoning-gym dataset name, e.g. basic_arithmetic")
    size: int = Field(64, ge=1, description="Number of items to generate")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword args of the generator")


class DataConfig(Stage):
    path: str | None = Field(None, description="JSONL or Parquet file with prompt, answer[, id, task, difficulty]")
    generators: list[GeneratorSpec] = Field(
        default_factory=lambda: [GeneratorSpec(task="basic_arithmetic", size=96,
                                               params={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                       "max_digits": 1})],
        description="reasoning-gym generators used when `path` is not set",
    )
    seed: int = Field(0, description="Seed of generation and of the train / held-out split")
    heldout_size: int = Field(16, ge=1, description="Rows kept out of training for evaluation")
    max_prompt_tokens: int = Field(256, ge=8, description="Prompts longer than this (after the chat template) are invalid")
    on_invalid: Literal["error", "drop"] = Field("error", description="Refuse invalid rows, or drop them and log them")
    instruction: str = Field(" Reply with only the final number.", description="Appended to every prompt")
    system_prompt: str | None = Field(None, description="Optional system message of the chat template")


class SpecStrategy(Stage):
    depth: int = Field(4, ge=0, le=16, description="Draft steps per round (0 = plain decoding, no draft)")
    topk: int = Field(1, ge=1, le=8, description="Branching of the draft tree (1 = chain)")
    tokens: int = Field(4, ge=0, le=64, description="Draft tokens verified per round (0 with depth 0)")
    source: Literal["drafter", "ngram"] = Field("drafter", description="Who drafts: the trained drafter, or "
                                                "model-free n-gram lookup over the sequence, the other samples of "
                                                "its GRPO group and earlier rollouts of its prompt")

    @model_validator(mode="after")
    def _plain_is_both_zero(self):
        if (self.depth == 0) != (self.tokens == 0):
            raise ValueError("depth and tokens must both be 0 (plain decoding) or both >= 1")
        return self

    @property
    def plain(self) -> bool:
        return self.depth == 0

    @property
    def name(self) -> str:
        """'chain4', 'tree4x2t8' or 'plain': how reports name a strategy."""
        if self.plain:
            return "plain"
        shape = f"chain{self.depth}" if self.topk == 1 else f"tree{self.depth}x{self.topk}t{self.tokens}"
        return shape if self.source == "drafter" else f"ngram-{shape}"


class DrafterConfig(Stage):
    draft_vocab_size: int = Field(2048, ge=0, description="Reduced draft vocabulary; 0 = the target's full vocabulary")
    aux_layer_ids: list[int] | None = Field(None, description="Target hidden_states ids (low, mid, high); default 2, N//2, N-3")
    init_from_target: bool = Field(False, description="Start the drafter's decoder layer from the target's "
                                   "last layer (fc passes the high aux feature through) instead of at random")
    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate of the warm-start")
    refresh_lr: float | None = Field(None, gt=0, description="Constant LR of online refreshes (default: where the "
                                     "warm-start's cosine ends, lr * min_lr_ratio)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip")
    precision: Literal["auto", "fp32", "bf16-mixed"] = Field(
        "auto", description="Drafter warm-start and refreshes: fp32, or bf16-mixed (fp32 weights and optimizer, bf16 "
        "autocast); auto = as trainer.precision")
    loss_feature_weight: float = Field(0.0, ge=0, description="Weight of the SmoothL1 feature loss (EAGLE-3 drops it: 0; "
                                       "EAGLE-1/TLT style > 0)")
    loss_token_weight: float = Field(1.0, ge=0, description="Weight of the soft cross-entropy loss against the target")
    ttt_steps: int = Field(4, ge=1, le=8, description="Training-time-test unroll steps (EAGLE-3); 1 = off")
    ttt_decay: float = Field(0.8, gt=0, le=1, description="Weight of unroll step k is ttt_decay**k (normalised; "
                             "SpecForge: 0.8)")
    feature_target: Literal["fused", "final"] = Field(
        "fused", description="Feature-loss target of the fed-back h: the next position's fused aux "
        "(what h replaces when drafting) or, TLT/EAGLE-1 style, the target's final hidden (on norm(h))")
    train_on_prompt: bool = Field(True, description="Also learn the target's next-token distribution on prompt "
                                  "positions (packed batches compute them anyway), weighted by prompt_loss_weight")
    prompt_loss_weight: float = Field(0.1, ge=0, le=1, description="Loss weight of a prompt position relative to a "
                                      "response position (with train_on_prompt), in the warm-start and in "
                                      "online refreshes")
    corpus_tokens: int = Field(16384, ge=256, description="Response tokens of the self-distilled warm-start corpus "
                               "(the target's own greedy + rollout-temperature answers to fresh task prompts)")
    corpus_prompts_per_batch: int = Field(64, ge=1, description="Prompts per batched generate() while the corpus is built")
    warmstart_max_new_tokens: int = Field(64, ge=1, description="Length cap of the corpus responses")
    warmstart_epochs: int = Field(3, ge=1, description="Passes over the warm-start corpus")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Warm-start LR warmup share (then cosine decay to "
                                "min_lr_ratio); online refreshes use the constant lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final warm-start LR as a share of lr")
    batch_tokens: int = Field(512, ge=64, description="Tokens per packed training batch (small batches, more steps: "
                              "measured better at warm-start budgets of a few hundred steps)")
    warmstart_eval_prompts: int = Field(32, ge=1, description="Held-out prompts for accept-length reports")
    eval_max_new_tokens: int = Field(48, ge=1, description="Tokens per prompt in accept-length reports")
    eval_strategy: SpecStrategy = Field(default_factory=lambda: SpecStrategy(depth=4, topk=1, tokens=4),
                                          description="The fixed strategy of accept-length reports (tuner off; "
                                          "default: a depth-4 chain)")
    schedule: Literal["frozen", "every_k", "below_accept", "payoff"] = Field(
        "payoff", description="When the online drafter trains: frozen = never after the warm-start; every_k = in "
        "RL steps k-1, 2k-1, ... (k = refresh_every); below_accept = in the step after a rollout whose accept "
        "length fell under refresh_below_accept_len; payoff = when the rollout time a refresh is estimated to "
        "save over the next payoff_horizon steps exceeds its measured cost")
    where: Literal["spot", "sequential"] = Field(
        "spot", description="Where a due refresh trains: spot = in that step's rollout tail (spot trainer process, "
        "for as long as the tail lasts); sequential = refresh_steps drafter steps after the policy update")
    refresh_every: int = Field(1, ge=1, description="k of schedule every_k")
    refresh_steps: int = Field(8, ge=1, description="Drafter optimizer steps per sequential refresh (where: "
                               "sequential)")
    refresh_below_accept_len: float | None = Field(None, gt=0, description="Bound of schedule below_accept: train "
                                                   "after a rollout whose accept length (spec/accept_len/mean) is "
                                                   "below it")
    payoff_horizon: int = Field(4, ge=1, description="RL steps over which schedule payoff credits a refresh with "
                                "the rollout time it saves")
    spot_threads: int = Field(1, ge=1, description="Torch threads of the spot trainer process")
    spot_checkpoint_every: int = Field(16, ge=0, description="The spot trainer saves its weights + optimizer every k "
                                       "drafter steps (async; a preempted worker loses at most k steps; 0 = only "
                                       "at the end of each tail)")
    buffer_steps: int = Field(2, ge=1, description="RL steps of rollouts kept in the online buffer (one-step offset = 2)")
    buffer_max_tokens: int = Field(65536, ge=1024, description="Memory bound of the online buffer, in tokens")

    @field_validator("refresh_every", mode="before")
    @classmethod
    def _every_is_k(cls, k):
        if k == 0 or k == "0":
            raise ValueError("refresh_every is the k of schedule every_k (>= 1); for a drafter that never trains "
                             "after its warm-start set drafter.schedule: frozen")
        return k

    @model_validator(mode="after")
    def _schedule_keys(self):
        s = self.schedule
        if s == "below_accept" and self.refresh_below_accept_len is None:
            raise ValueError("drafter.schedule: below_accept needs its bound: set drafter.refresh_below_accept_len")
        if s != "below_accept" and self.refresh_below_accept_len is not None:
            raise ValueError(f"drafter.refresh_below_accept_len is the bound of schedule below_accept, but "
                             f"drafter.schedule is {s}: set drafter.schedule: below_accept or drop the bound")
        for key, owner in (("refresh_every", "every_k"), ("payoff_horizon", "payoff")):  # a non-default value
            if getattr(self, key) != type(self).model_fields[key].default and s != owner:
                raise ValueError(f"drafter.{key} is read by schedule {owner} only, but drafter.schedule is {s}: "
                                 f"set drafter.schedule: {owner} or drop drafter.{key}")
        return self


class RolloutConfig(Stage):
    backend: Literal["torch", "vllm"] = Field("torch", description="Embedded torch engine or vLLM")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Dtype of the rollout engines' copy of the policy, rounded from the master weights at each "
        "sync (auto: bfloat16 when trainer.precision resolves to bf16-mixed, else model.dtype)")
    workers: int = Field(1, ge=1, le=64, description="Rollout worker processes (CPU): GRPO groups are sharded across "
                         "them, each with its share of the threads, over shared-memory weights; the spot trainer "
                         "starts when the first one finishes")
    group_size: int = Field(4, ge=1, description="Samples per prompt (GRPO group G)")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per RL step")
    max_new_tokens: int = Field(64, ge=1, description="Response length limit")
    temperature: float = Field(0.7, ge=0, description="Sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling")
    spec: bool = Field(True, description="Use speculative decoding")
    spec_threshold: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="SD on when running sequences <= this (the tail switch). auto: the largest batch size at "
        "which this machine's cost curve, measured at engine start, says SD pays at the drafter's measured "
        "acceptance (tlt.rollout.breakeven; the torch engine: at most 8; 8 where no curve is measured, e.g. "
        "rollout.tuner_calibrate false)")
    spec_patience: int = Field(0, ge=0, description="SD switches on only after this many consecutive decode steps "
                               "at or under spec_threshold (TLT uses 10 on GPUs; 0 = at once)")
    drafter: Literal["eagle", "ngram"] = Field("eagle", description="Trained drafter, or model-free prompt lookup")
    sampled_drafts: bool = Field(True, description="At temperature > 0, chains draw their drafts from the drafter's "
                                 "distribution q and accept with min(1, p/q) (accepts 1 - TV(p, q)); false = argmax "
                                 "drafts accepted as point masses with p(x). Both lossless")
    draft_stop_below: float = Field(0.0, ge=0, lt=1, description="Chains stop where the calibrated chance that the "
                                    "next draft is used (it and all before it accepted; calibrated online per depth "
                                    "against the drafter's probability) falls below this; ~0.14 = the cost of a "
                                    "verified token on 2 CPU cores (0 = off)")
    draft_min_prob: float = Field(0.0, ge=0, lt=1, description="Drop draft tokens whose drafter path probability "
                                  "(product down the tree) is below this, so unconfident rounds verify fewer tokens "
                                  "(lossless; pays where verify cost grows with tokens, as on CPU; 0 = off; EAGLE "
                                  "drafter, torch engine)")
    strategy: SpecStrategy = Field(default_factory=SpecStrategy, description="Strategy when the tuner is off")
    tuner: bool = Field(True, description="Pick the strategy per batch bucket with the bandit")
    tuner_epsilon: float = Field(0.1, ge=0, le=1, description="Exploration rate of the bandit")
    tuner_buckets: list[int] = Field(default_factory=lambda: [1, 2, 5, 21], description="Lower bounds of batch-size buckets")
    tuner_plain_arm: bool = Field(True, description="The bandit may also choose plain decoding in a bucket (SD off "
                                  "where drafting does not pay for itself)")
    tuner_calibrate: bool = Field(True, description="At engine start, time a decode step and an SD round per "
                                  "tuner bucket and draft depth (a few short calls) and start the bandit from the "
                                  "rewards they predict: buckets where no depth can pay start on plain decoding "
                                  "(docs/concepts.md: Calibrate before exploring)")
    tuner_ngram_arms: bool = Field(True, description="The bandit may also choose model-free n-gram drafts (arms with "
                                   "source ngram) in a bucket, next to the trained drafter's")
    guard_patience: int = Field(3, ge=0, description="Spec guard: a batch-size tier (tuner_buckets) whose rollouts "
                                "accept fewer tokens per SD round than its break-even (an SD round's time over a plain "
                                "step's, measured in the same rollout) this many times in a row decodes without SD "
                                "until the drafter changes (spec/guard_tripped counts such tiers; 0 = never)")
    group_drafts: bool = Field(True, description="N-gram drafts also look up the other samples of the sequence's GRPO "
                               "group (finished ones included) and earlier rollouts of the same prompt")
    history_per_prompt: int = Field(8, ge=0, description="Earlier responses kept per prompt for n-gram drafts "
                                    "(the newest; 0 = none; in memory, per engine, not checkpointed)")
    history_prompts: int = Field(2048, ge=1, description="Prompts whose earlier responses are kept (least recently "
                                 "used dropped first)")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine options (rollout.backend: vllm)")

    @model_validator(mode="after")
    def _workers_need_torch(self):
        if self.workers > 1 and self.backend != "torch":
            raise ValueError("rollout.workers > 1 shards the torch engine over processes; vLLM batches on its own: "
                             "set rollout.workers: 1 with rollout.backend: vllm")
        return self


class RLConfig(Stage):
    steps: int = Field(4, ge=0, description="RL steps")
    lr: float = Field(1e-6, gt=0, description="Policy learning rate")
    weight_decay: float = Field(0.01, ge=0, description="Policy AdamW weight decay")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Policy optimizer: adamw, or sgd (plain, no "
                                               "momentum: an update linear in the gradient, as in the data-parallel "
                                               "equality tests)")
    clip_low: float = Field(0.2, ge=0, description="PPO clip epsilon (low)")
    clip_high: float = Field(0.28, ge=0, description="PPO clip epsilon (high; DAPO clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (0 = none)")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus")
    filter_zero_std: bool = Field(False, description="Drop groups whose rewards all agree")
    fused_old_logprob: bool = Field(True, description="Take the old log-probs and the drafter's hidden states from "
                                    "the update's own forward (one optimizer step per RL step makes them equal); "
                                    "false = a separate no-grad forward first (always so with kl_coef > 0)")
    reward: str = Field("auto", description="Reward: auto (reasoning-gym scorer or math-verify), math, reasoning_gym, "
                        "or a user function 'module:function'")
    seed: int = Field(0, description="Seed of sampling and training")


class TrainerConfig(Stage):
    backend: Literal["torch", "deepspeed"] = Field("torch", description="Policy update backend")
    device: TrainDevice = DEVICE_FIELD
    world_size: int = Field(1, ge=1, le=1024, description="DeepSpeed ranks of the policy update (> 1: Ray actors "
                            "forming one process group, gloo on CPU; needs cluster.backend: ray and backend: deepspeed)")
    zero_stage: int = Field(0, ge=0, le=2, description="DeepSpeed ZeRO stage")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward")
    group_by_length: bool = Field(True, description="Micro-batches of rows of similar length (longest first), each "
                                  "trimmed to its longest row: little padding on ragged, long-tail responses; "
                                  "false = rollout order")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip")
    precision: Literal["auto", "fp32", "bf16-mixed"] = Field(
        "auto", description="Policy update: fp32, or bf16-mixed (fp32 master weights and optimizer state, bf16 "
        "autocast forward/backward, loss in fp32); auto = bf16-mixed where the device has bf16 units (CUDA, or a "
        "CPU with avx512_bf16/amx_bf16), else fp32")
    allow_low_precision_update: bool = Field(False, description="Let a bfloat16/float16 model.dtype be updated in "
                                             "place (no fp32 master weights: small steps round away)")
    checkpoint_dir: str = Field("runs", description="Root of run checkpoints")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint every k RL steps")
    checkpoint_keep: int = Field(3, ge=1, description="Run checkpoints kept (older ones are pruned)")
    optimizer_keep: int = Field(1, ge=1, description="Newest checkpoints that keep the policy's optimizer state "
                                "(what a resume needs to continue exactly); older ones keep the weights only")


class EvalConfig(Stage):
    max_new_tokens: int = Field(32, ge=1, description="Greedy evaluation length")
    every: int = Field(2, ge=0, description="Evaluate every k RL steps (0 = only at the end)")
    batch_size: int = Field(16, ge=1, description="Prompts per evaluation batch")


class TrackingConfig(Stage):
    experiment: str = Field("tlt", description="MLflow experiment")
    tracking_uri: str | None = Field(None, description="MLflow URI; MLFLOW_TRACKING_URI wins; default sqlite under mlflow/")
    system_metrics: bool = Field(True, description="Log CPU/memory system metrics")
    samples_every: int = Field(1, ge=0, description="Log a table of rollout samples every k steps (0 = never)")
    flush_timeout_s: float = Field(60.0, ge=0, le=3600, description="At the end of a run, retry sending what an MLflow "
                                   "outage left in the spool for up to this long (backoff 1-15 s); then exit 3 and "
                                   "leave it to `tlt tracking sync`")


class ExportConfig(Stage):
    enabled: bool = Field(True, description="Write the run's model folder at the end of training: policy/ (a "
                          "save_pretrained folder), drafter/ (EAGLE-3) and a README.md with the serve commands")
    out_dir: str | None = Field(None, description="Model folder (default: the run's checkpoint dir /model)")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Precision of the exported "
                                                              "weights (the folder's accept lengths are measured in it)")
    register_model: bool = Field(True, description="Log the folder as the run's MLflow model and register it as a "
                                 "version of `model_name`")
    model_name: str = Field("tlt-model", description="MLflow registered model name (retraining continues from its "
                            "`champion` version; `tlt-drafter` is the older drafter-only registry)")


class DeployConfig(Stage):
    cron: str = Field("0 3 * * *", description="Schedule of the tlt-train/retrain deployment")
    timezone: str = Field("UTC", description="IANA time zone of the cron schedule (e.g. Europe/Paris)")
    on_missing_champion_policy: Literal["error", "base"] = Field(
        "error", description="Retrain from an older drafter-only champion whose policy checkpoint is gone: stop with "
        "an error naming the path, or continue from the base policy (model.name_or_path; logged as a warning, tag "
        "retrain.policy=base)")
    promote_accuracy_alpha: float = Field(0.05, gt=0, lt=0.5, description="Retrain promotion: significance of the "
                                          "one-sided two-proportion test that refuses a version whose held-out "
                                          "accuracy dropped below the champion's")
    promote_accuracy_tolerance: float = Field(0.0, ge=0, le=1, description="Retrain promotion: a drop of held-out "
                                              "accuracy up to this much is accepted before the test applies")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, tz: str) -> str:
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"'{tz}' is not an IANA time zone; use e.g. UTC or Europe/Paris") from None
        return tz


class RunConfig(Stage):
    name: str = Field("tlt", description="Run name shown in Prefect and MLflow")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.rl.clip_high < self.rl.clip_low:
            raise ValueError("rl.clip_high must be >= rl.clip_low (DAPO clip-higher); raise rl.clip_high")
        if self.rl.reward not in ("auto", "math", "reasoning_gym") and ":" not in self.rl.reward:
            raise ValueError(f"rl.reward '{self.rl.reward}' is unknown; use auto, math, reasoning_gym or 'module:function'")
        if self.trainer.zero_stage and self.trainer.backend != "deepspeed":
            raise ValueError("trainer.zero_stage needs trainer.backend: deepspeed; set it or drop zero_stage")
        self._precision_checks()
        self._cluster_checks()
        return self

    def _precision_checks(self) -> None:
        low = self.model.dtype != "float32"
        if low and self.trainer.precision == "bf16-mixed":
            raise ValueError(f"trainer.precision: bf16-mixed keeps fp32 master weights, but model.dtype is "
                             f"{self.model.dtype}: set model.dtype: float32 (the rollout's {self.model.dtype} copy is "
                             f"rollout.dtype: {self.model.dtype})")
        if low and self.rl.steps > 0 and not self.trainer.allow_low_precision_update:
            raise ValueError(f"model.dtype: {self.model.dtype} updates the policy in {self.model.dtype} itself, with no "
                             f"fp32 master weights: at rl.lr {self.rl.lr:g} most AdamW steps are smaller than "
                             f"{self.model.dtype}'s resolution and round away (measured: 1.9 % of the weights move "
                             f"at lr 1e-6). Set model.dtype: float32 with trainer.precision: bf16-mixed (bf16 compute, "
                             f"fp32 master) and rollout.dtype: {self.model.dtype}, or trainer.allow_low_precision_update:"
                             f" true to do it anyway")

    def _cluster_checks(self) -> None:
        if self.trainer.world_size > 1 and self.trainer.backend != "deepspeed":
            raise ValueError("trainer.world_size > 1 runs DeepSpeed ZeRO ranks: set trainer.backend: deepspeed")
        if self.trainer.world_size > 1 and self.cluster.backend != "ray":
            raise ValueError("trainer.world_size > 1 places the trainer ranks as Ray actors: set cluster.backend: ray")
        if self.cluster.backend == "ray" and self.rollout.workers > 1:
            raise ValueError("cluster.backend: ray shards rollouts over cluster.rollout_actors; set rollout.workers: 1")
        if self.cluster.backend == "ray":
            placement_checks(self.cluster, self.trainer, self.rollout.backend, self.rollout.vllm)
