#!/usr/bin/env bash
# ResNet-34 on CIFAR-100, the tutorial's setup (20 epochs, batch 128, Adam, fp16), pre-emption safe.
#
#   sbatch recipes/slurm_resnet34_cifar100.sh [OVERRIDES...]     on a SLURM cluster
#   bash   recipes/slurm_resnet34_cifar100.sh [OVERRIDES...]     anywhere else (same behaviour)
#
# Shortly before the time limit SLURM sends SIGTERM (see --signal); rptrain finishes its step,
# writes checkpoints/last.pt and exits with 143; the job then requeues itself and the rerun
# continues from the checkpoint (trainer.resume=auto finds the run with the same overrides).
# Environment knobs: MODEL, DATA, DATA_ROOT (a folder with cifar-100-python/, or where to
# download it), RPTRAIN (the command, default: rptrain).
#
#SBATCH --job-name=rptrain-resnet34-cifar100
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

MODEL=${MODEL:-resnet34}
DATA=${DATA:-cifar100}
RPTRAIN=${RPTRAIN:-rptrain}
args=(model="$MODEL" data="$DATA" trainer.resume=auto)
if [[ -n "${DATA_ROOT:-}" ]]; then args+=(data.root="$DATA_ROOT"); fi
# Under SLURM a requeued job keeps its id: give it one run directory for all its attempts.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then args+=(hydra.run.dir="outputs/slurm-${SLURM_JOB_ID}"); fi

# Run rptrain as a child so this shell can pass SIGTERM/SIGINT on and requeue afterwards.
# $RPTRAIN is unquoted on purpose: it may be a command with arguments (python -m rptrain.cli.main).
$RPTRAIN "${args[@]}" "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM
trap 'kill -INT "$pid" 2>/dev/null || true' INT
rc=0
wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do  # a trapped signal ended `wait` early: the checkpoint is being written
  rc=0
  wait "$pid" || rc=$?
done

if [[ $rc -eq 143 && -n "${SLURM_JOB_ID:-}" ]]; then
  echo "pre-empted: requeueing job $SLURM_JOB_ID; it will resume from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
