"""The torch engine: batched decoding in this process with a slot KV cache (cache.py), plain and
speculative rounds (spec.py) over per-call state (state.py), sampling, the n-gram drafter, the
cost-curve calibrator and the engine's copy of the policy's weights."""
