#!/usr/bin/env bash
# Main job launcher: DeepSpeed ZeRO-1 on NUM_RANKS CPU processes (gloo).
#   launch/train.sh                        # tiny preset, 2 ranks, configs/run_tiny.yaml
#   NUM_RANKS=4 launch/train.sh --set steps=50
#   launch/train.sh --resume               # continue from the latest checkpoint
#   launch/train.sh --compare              # CanzonaMuon vs Muon vs AdamW + exact reference
# Extra arguments go to canzona_ds.cli.train (see its --help).
set -euo pipefail
NUM_RANKS=${NUM_RANKS:-2}
RUN_CONFIG=${RUN_CONFIG:-configs/run_tiny.yaml}
MASTER_PORT=${MASTER_PORT:-$((29500 + RANDOM % 1000))}
DS_ARGS=()
if [[ -n "${DS_CONFIG:-}" ]]; then DS_ARGS=(--ds-config "$DS_CONFIG"); fi
cd "$(dirname "$0")/.."
exec deepspeed --num_gpus "$NUM_RANKS" --master_port "$MASTER_PORT" \
    --module canzona_ds.cli.train --config "$RUN_CONFIG" "${DS_ARGS[@]}" "$@"
