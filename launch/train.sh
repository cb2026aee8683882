#!/usr/bin/env bash
# Main job launcher: DeepSpeed ZeRO (stage 1 by default, 3 with the zero3 ds_config) on NUM_RANKS
# CPU processes (gloo).
#   launch/train.sh                        # tiny preset, 2 ranks, configs/run_tiny.yaml
#   NUM_RANKS=4 launch/train.sh --set steps=50
#   NUM_RANKS=4 launch/train.sh --set pp=2    # 2 pipeline stages x 2 DP ranks
#   DS_CONFIG=configs/ds_cpu_canzona_zero3.json launch/train.sh   # ZeRO stage 3 (docs/zero3.md)
#   launch/train.sh --resume               # continue from the latest intact checkpoint
#   launch/train.sh --compare              # CanzonaMuon vs Muon vs AdamW + exact reference
# Extra arguments go to canzona_ds.cli.train (see its --help).
#
# The launcher runs in its own process group (set -m).  SIGTERM / SIGINT to this script are
# forwarded to the whole group (launcher, its per-node launch.py, every rank); the script
# waits for the group to end (SIGKILL after STOP_GRACE_S seconds), then removes this user's
# DeepSpeed /dev/shm all-reduce buffers of MASTER_PORT (left when a rank died before it could
# unlink its own, e.g. SIGKILLed during start-up).  Exit status: the launcher's, or 130 / 143
# when stopped by SIGINT / SIGTERM.  The launcher's is the job's: DeepSpeed's launch.py exits
# with the first failing rank's status and runner.py passes it on, so the entry's documented
# codes (2 bad config, 3 optimizer unavailable, 4 checkpoint error) arrive here unchanged.
# Output goes to runs/<config>-<optimizer>-<time>/ (runs/latest -> it) unless log_dir is set.
set -euo pipefail
NUM_RANKS=${NUM_RANKS:-2}
RUN_CONFIG=${RUN_CONFIG:-configs/run_tiny.yaml}
MASTER_PORT=${MASTER_PORT:-$((29500 + RANDOM % 1000))}
STOP_GRACE_S=${STOP_GRACE_S:-45}
DS_ARGS=()
if [[ -n "${DS_CONFIG:-}" ]]; then DS_ARGS=(--ds-config "$DS_CONFIG"); fi
cd "$(dirname "$0")/.."

LAUNCHER_PID=""
STOP_RC=""

group_alive() { [[ -n "$LAUNCHER_PID" ]] && kill -0 -- "-$LAUNCHER_PID" 2>/dev/null; }

cleanup() {
    # wait for every process of the launcher's group, then remove its shm buffers
    local waited=0
    while group_alive; do
        if (( waited >= STOP_GRACE_S * 5 )); then
            kill -KILL -- "-$LAUNCHER_PID" 2>/dev/null || true
        fi
        sleep 0.2
        waited=$((waited + 1))
    done
    rm -f -- /dev/shm/deepspeed_allreduce_buffer_"$(id -u)"_*_"${MASTER_PORT}"_*
}

stop() {  # $1: signal name, $2: exit status
    STOP_RC=$2
    trap '' TERM INT  # one forwarding is enough; a repeated Ctrl-C must not abort the cleanup
    if [[ -n "$LAUNCHER_PID" ]]; then kill -s "$1" -- "-$LAUNCHER_PID" 2>/dev/null || true; fi
}

trap cleanup EXIT
trap 'stop TERM 143' TERM
trap 'stop INT 130' INT

if [[ -n "$STOP_RC" ]]; then exit "$STOP_RC"; fi  # stopped before the launch
set -m
deepspeed --num_gpus "$NUM_RANKS" --master_port "$MASTER_PORT" \
    --module canzona_ds.cli.train --config "$RUN_CONFIG" "${DS_ARGS[@]}" "$@" &
LAUNCHER_PID=$!
set +m

rc=0
while :; do
    # `wait` returns early (status > 128) when a trapped signal arrives; wait again until
    # the launcher itself has exited
    if wait "$LAUNCHER_PID"; then rc=0; else rc=$?; fi
    kill -0 "$LAUNCHER_PID" 2>/dev/null || break
done
if [[ -n "$STOP_RC" ]]; then rc=$STOP_RC; fi
exit "$rc"
