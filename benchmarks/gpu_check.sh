#!/usr/bin/env bash
# Builds mpcore and proves its NCCL path on a machine with CUDA GPUs, in one
# command and within 10 minutes:
#   bash benchmarks/gpu_check.sh
# It uses the python3 (and torch with CUDA) already there, builds the
# extension in place, then runs benchmarks/gpu_check.py, which checks
# mpcore's NCCL all-reduce, broadcast and all-gather against torch's own
# NCCL, runs DDP on CUDA tensors, checks a group made by torch's own
# init_process_group("cpu:mpcore,cuda:nccl") (a CPU all-reduce served by
# mpcore, a CUDA one by NCCL), times the all-reduce, runs the article's
# ddp.py when there are 4 GPUs or more, and prints a short table last.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== machine"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
$PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' || exit 1
echo "== build"
$PY -m pip --version >/dev/null 2>&1 && ($PY -c 'import numpy' 2>/dev/null || $PY -m pip install -q numpy)
$PY setup.py build_ext --inplace -q 2>&1 | grep -v "^$" | tail -5
export PYTHONPATH="$PWD/pkg${PYTHONPATH:+:$PYTHONPATH}"
$PY -c 'import mpcore, mpcore.dist._nccl as n; print("NCCL from", n.load())' || exit 1
echo "== checks"
timeout 540 $PY benchmarks/gpu_check.py
