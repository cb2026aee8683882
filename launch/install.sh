#!/usr/bin/env bash
# Install canzona-ds and its dependencies.
#   bash launch/install.sh              # package + test, plot and hf (transformers, for AutoTP and HF Trainer) extras
#   CPU_ONLY=1 bash launch/install.sh   # the same, torch from PyTorch's CPU wheel index
# torch comes first, so that deepspeed's dependency on torch is already satisfied.  Which torch
# build that is depends on where pip looks:
#   * default: pip's configured index (PyPI unless pip.conf / PIP_INDEX_URL say otherwise).  On
#     x86-64 Linux PyPI's torch==2.13.0 is the CUDA build (~GBs of nvidia-* wheels): right for a
#     GPU host, and it also runs on CPU; a machine whose pip is preconfigured with a CPU mirror
#     gets the CPU build.
#   * CPU_ONLY=1: adds --index-url https://download.pytorch.org/whl/cpu for torch, so a CPU-only
#     machine gets the small CPU wheel (that index must be reachable; PyPI alone does not have it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_INDEX=()
if [[ "${CPU_ONLY:-0}" == "1" ]]; then TORCH_INDEX=(--index-url https://download.pytorch.org/whl/cpu); fi
"$PY" -m pip install --quiet "${TORCH_INDEX[@]}" "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[test,plot,hf]"
"$PY" -c "import torch, deepspeed, canzona_ds; print(f'installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}, canzona_ds {canzona_ds.__version__}')"
# Build DeepSpeed's CPU shared-memory all-reduce op now (a JIT build, ~1 min) rather than inside
# the first job or test, where it would run in every rank at once behind a file lock.  It is
# cached in this environment's own folder (canzona_ds.op_cache_dir(), which `import canzona_ds`
# makes TORCH_EXTENSIONS_DIR unless that is set), where launch/train.sh's ranks and the suite
# load it, and where another environment's build cannot invalidate it (torch's default,
# ~/.cache/torch_extensions/py3XX_cpu, is shared by every environment of that Python version).
# DeepSpeed skips the op where it is incompatible.
"$PY" - <<'PYEOF'
import importlib, os
import canzona_ds  # first: sets TORCH_EXTENSIONS_DIR to this environment's op cache
ds_comm = importlib.import_module("deepspeed.comm.torch")  # the module, not the name torch
print("deepspeed shm op:", "ready" if ds_comm.build_shm_op() is not None else "not used on this machine",
      "in", os.environ["TORCH_EXTENSIONS_DIR"])
PYEOF
