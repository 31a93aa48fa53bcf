#!/usr/bin/env bash
# Data-parallel training over several machines: each machine runs one engine over all its GPUs and
# the machines average gradients through torch.distributed (NCCL), launched by srun + torchrun.
# Pre-emption safe: SIGTERM -> every rank finishes its step, rank 0 checkpoints, the job requeues
# itself and the rerun resumes (trainer.resume=auto), on any number of nodes that divides the batch.
#
#   sbatch --nodes=4 recipes/slurm_multinode.sh [OVERRIDES...]   on a SLURM cluster
#   bash recipes/slurm_multinode.sh [OVERRIDES...]               without SLURM: the same launch on this
#                                                                machine (torchrun --standalone, 2 CPU
#                                                                processes, a tiny model): a smoke test
#
# trainer.batch_size is the GLOBAL batch: each of the N ranks trains on batch_size/N samples per step.
# output_root must be on a filesystem every node sees: rank 0 writes the run directory and every
# rank reads the checkpoint it resumes from.
# Environment knobs: MODEL, DATA (SLURM defaults llama_1b on data=text; add data.path=CORPUS),
# BATCH (global batch), NPROC_PER_NODE (1: one engine over all of a machine's GPUs; the number of
# GPUs: one engine per GPU), PORT (rendezvous port on the first node), TORCHRUN (the launcher,
# default torchrun; e.g. "python -m torch.distributed.run").
#
# NCCL notes: export NCCL_SOCKET_IFNAME=<interface> (e.g. ib0 or eth0) when nodes have several
# networks, NCCL_IB_HCA=<hca> to pick InfiniBand adapters, NCCL_DEBUG=WARN (INFO to see the chosen
# transport). A dead or hung rank ends the run after dist.timeout_s (default 600 s) with a one-line
# error on the others; srun --kill-on-bad-exit ends the whole step when one node's torchrun fails.
#
# A frozen node that hosts torchrun's rendezvous store (the first node): the ranks elsewhere fail their
# collective after dist.timeout_s and exit with one line, but their torchrun can stay blocked in a store
# call for good (torch 2.14: the agent's rendezvous check ignored read_timeout once the store host stopped,
# seen with SIGSTOP). So torchrun runs under node_launch below, which stops it RANKS_GONE_GRACE seconds
# (default 120) after its last rank ended; srun --kill-on-bad-exit then ends the other nodes. The job
# therefore ends within dist.timeout_s + RANKS_GONE_GRACE + a few seconds (dist.timeout_s + 130 s by
# default). The store calls themselves are bounded too (--rdzv-conf read_timeout=30, close_timeout=15;
# torch's defaults are 60 and 30 s), and RDZV_JOIN_TIMEOUT (600 s) bounds the wait for every node at start.
#
#SBATCH --job-name=rptrain-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

TORCHRUN=${TORCHRUN:-torchrun}
PORT=${PORT:-29500}
# torchrun waits this long (default 30 s) after forwarding SIGTERM before it SIGKILLs the ranks:
# long enough for rank 0 to write a big checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# torchrun on this node, stopped if it outlives its ranks by RANKS_GONE_GRACE seconds (see the top).
node_launch() {
  "$@" &
  local pid=$! seen=0 idle=0 rc=0
  trap 'kill -TERM $pid 2>/dev/null' TERM
  trap 'kill -INT $pid 2>/dev/null' INT
  while kill -0 "$pid" 2>/dev/null; do
    # A rank still running (a finished one stays a zombie while torchrun is blocked and does not reap it).
    if ps -o stat= --ppid "$pid" | grep -qv '^Z'; then seen=1 idle=0; elif ((seen)); then idle=$((idle + 1)); fi
    if ((idle > ${RANKS_GONE_GRACE:-120})); then
      echo "slurm_multinode: torchrun on $(hostname) still runs ${RANKS_GONE_GRACE:-120} s after its ranks ended: stopping it" >&2
      kill -KILL "$pid" 2>/dev/null
    fi
    sleep 1 & wait $! || true
  done
  wait "$pid" || rc=$?
  return $rc
}
export -f node_launch  # srun runs it on every node through bash -c

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  MODEL=${MODEL:-llama_1b}
  DATA=${DATA:-text}
  BATCH=${BATCH:-$((64 * SLURM_NNODES))}
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  # One torchrun per node (ntasks-per-node=1); c10d rendezvous on the first node.
  launch=(srun --kill-on-bad-exit=1 bash -c 'node_launch "$@"' node_launch $TORCHRUN --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE"
          --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head:$PORT" --max-restarts 0
          --rdzv-conf "join_timeout=${RDZV_JOIN_TIMEOUT:-600},read_timeout=${RDZV_READ_TIMEOUT:-30},close_timeout=${RDZV_CLOSE_TIMEOUT:-15}")
  args=(model="$MODEL" data="$DATA" precision=bf16 trainer.batch_size="$BATCH"
        hydra.run.dir="outputs/slurm-${SLURM_JOB_ID}")  # a requeued job keeps its id: one directory for all attempts
else
  MODEL=${MODEL:-llama_tiny}
  DATA=${DATA:-synthetic_tokens}
  BATCH=${BATCH:-16}
  NPROC_PER_NODE=${NPROC_PER_NODE:-2}
  export OMP_NUM_THREADS=1  # two processes on a small machine
  launch=(node_launch $TORCHRUN --standalone --nproc-per-node "$NPROC_PER_NODE")
  args=(model="$MODEL" data="$DATA" precision=fp32 trainer.batch_size="$BATCH" trainer.max_steps=40
        data.num_train=1024 data.seq_len=64 trainer.log_interval=10)
fi
args+=(trainer.resume=auto)

# Run the launcher as a child so this shell can pass SIGTERM/SIGINT on and requeue afterwards.
"${launch[@]}" -m rptrain.cli.main "${args[@]}" "$@" &
pid=$!
stopped=0
trap 'stopped=1; kill -TERM "$pid" 2>/dev/null || true' TERM
trap 'stopped=1; kill -INT "$pid" 2>/dev/null || true' INT
rc=0
wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do  # a trapped signal ended `wait` early: the checkpoint is being written
  rc=0
  wait "$pid" || rc=$?
done

# torchrun exits 1 whatever its ranks exited with: what matters is whether we were told to stop.
if [[ $stopped -eq 1 && $rc -ne 0 ]]; then
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    echo "pre-empted: requeueing job $SLURM_JOB_ID; it will resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 143
fi
exit "$rc"
