#!/usr/bin/env bash
# Shared by slurm_train.sh / slurm_test.sh: _slurm_run.sh TOOL PARTITION JOB_NAME [TOOL args...] (srun, one task per GPU)
# As mmdet's: GPUS (total, default 8), GPUS_PER_NODE (8), CPUS_PER_TASK (5), SRUN_ARGS from env.
set -x
TOOL=$1
PARTITION=$2
JOB_NAME=$3
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
# SRUN_ARGS is split into words on purpose (several srun options in one variable)
# shellcheck disable=SC2086
PYTHONPATH="$(dirname "$0")/..":${PYTHONPATH:-} \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    --gres=gpu:"$GPUS_PER_NODE" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$GPUS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    $SRUN_ARGS \
    python -u "$(dirname "$0")/$TOOL.py" "${@:4}"
