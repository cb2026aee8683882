#!/usr/bin/env bash
# Install canzona-ds and its dependencies on a fresh CPU machine.
#   bash launch/install.sh            # package + test, plot and hf (transformers, for AutoTP and HF Trainer) extras
# torch comes first, pinned to the CPU build, so that deepspeed's dependency on torch is
# already satisfied and pip pulls no CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[test,plot,hf]"
"$PY" -c "import torch, deepspeed, canzona_ds; print(f'installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}, canzona_ds {canzona_ds.__version__}')"
# Build DeepSpeed's CPU shared-memory all-reduce op now (a JIT build, ~1 min, cached in
# ~/.cache/torch_extensions) rather than inside the first job or test, where it would run in
# every rank at once behind a file lock.  DeepSpeed skips the op where it is incompatible.
"$PY" - <<'PYEOF'
import importlib
ds_comm = importlib.import_module("deepspeed.comm.torch")  # the module, not the name torch
print("deepspeed shm op:", "ready" if ds_comm.build_shm_op() is not None else "not used on this machine")
PYEOF
