#!/usr/bin/env bash
# Everything worth running on a GPU machine in one go: the engine tests on CUDA, then the
# benchmarks at full size. Usage: bash bench/gpu_suite.sh [tests|bench|all] ; logs go to $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())" | tee -a "$out/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_engine_*.py 2>&1 | tee "$out/tests.log" | tail -15
fi
if [[ $what == bench || $what == all ]]; then
  cd bench
  {
    python3 limits.py
    python3 resnet.py --trace
    python3 resnet.py --impl rptrain --no-graphs --steps 40
    python3 resnet.py --impl rptrain --microbatches 1 --steps 40
    python3 optimizer.py --params 21.3e6 302e6
  } 2>&1 | tee "$out/bench.jsonl"
fi
