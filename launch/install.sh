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
