"""The vLLM backend: `VllmRolloutEngine` (backend.py) drives a vLLM engine in a child process
(vllm_worker.py, run by the vLLM interpreter). Files named vllm_*.py run inside that process as
top-level modules (stdlib at import, never tlt); the others are tlt's side."""
