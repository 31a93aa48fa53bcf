#!/usr/bin/env bash
# Sweep the engine's microbatch count on ResNet-34 / CIFAR-100: one Hydra multirun, every job in
# this process (each job creates and closes its own engine). Prints a table of final metrics
# and throughput per job and writes outputs/multirun/DATE/TIME/sweep_summary.{json,csv}.
#
#   sbatch recipes/sweep_num_microbatch.sh [OVERRIDES...]
#   bash   recipes/sweep_num_microbatch.sh [OVERRIDES...]
#
# Environment knobs: MICROBATCHES (comma list, default 1,2,4,8), STEPS (optimizer steps per job,
# default 300), MODEL, DATA, DATA_ROOT, RPTRAIN (the command, default: rptrain).
#
#SBATCH --job-name=rptrain-sweep-num-microbatch
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

MICROBATCHES=${MICROBATCHES:-1,2,4,8}
STEPS=${STEPS:-300}
MODEL=${MODEL:-resnet34}
DATA=${DATA:-cifar100}
RPTRAIN=${RPTRAIN:-rptrain}
args=(-m model="$MODEL" data="$DATA" run_config.num_microbatch="$MICROBATCHES" trainer.max_steps="$STEPS")
if [[ -n "${DATA_ROOT:-}" ]]; then args+=(data.root="$DATA_ROOT"); fi

# $RPTRAIN is unquoted on purpose: it may be a command with arguments (python -m rptrain.cli.main).
exec $RPTRAIN "${args[@]}" "$@"
