#!/usr/bin/env bash
# Main job launcher: DeepSpeed ZeRO (stage 1 by default, 3 with the zero3 ds_config) on NUM_RANKS
# CPU processes (gloo).
#   launch/train.sh                        # tiny preset, 2 ranks, configs/run_tiny.yaml
#   launch/train.sh --help                 # the options (no rank is started)
#   NUM_RANKS=4 launch/train.sh --set steps=50
#   NUM_RANKS=4 launch/train.sh --set pp=2    # 2 pipeline stages x 2 DP ranks
#   DS_CONFIG=configs/ds_cpu_canzona_zero3.json launch/train.sh   # ZeRO stage 3 (docs/zero3.md)
#   launch/train.sh --resume               # continue from the latest intact checkpoint
#   launch/train.sh --compare              # CanzonaMuon vs Muon vs AdamW + exact reference
# Extra arguments go to canzona_ds.cli.train (see --help).  Environment: NUM_RANKS (2),
# RUN_CONFIG (configs/run_tiny.yaml), DS_CONFIG (the run config's), MASTER_PORT (29500 + random),
# STOP_GRACE_S (45), PYTHON (python3).
#
# Everything happens in canzona_ds/cli/launch.py (its docstring has the details): the config,
# the optimizer type, the checkpoint folder and --help are checked in one process before any
# rank starts (one line, exit 2; 4 for a checkpoint error); the ranks run with this
# environment's DeepSpeed op cache (the one launch/install.sh built); SIGINT / SIGTERM reach
# the ranks however this script was started (also `launch/train.sh &` from a script, where
# bash itself could not catch SIGINT); the job's /dev/shm buffers are removed at the end.
# Exit status: the job's (0 done, 2 bad config, 3 optimizer unavailable, 4 checkpoint error),
# or 130 / 143 when stopped by SIGINT / SIGTERM.
# Output goes to runs/<config>-<optimizer>-<time>/ (runs/latest -> it) unless log_dir is set.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m canzona_ds.cli.launch "$@"
