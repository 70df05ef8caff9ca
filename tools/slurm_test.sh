#!/usr/bin/env bash
# Usage: tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args...]
# Environment as mmdet's: GPUS (total, default 8), GPUS_PER_NODE (8), CPUS_PER_TASK (5), SRUN_ARGS.
exec bash "$(dirname "$0")/_slurm_run.sh" test "$1" "$2" "$3" "$4" --launcher=slurm "${@:5}"
