#!/usr/bin/env bash
# The GPU acceptance check of a lent GPU machine, in one call of at most 8 minutes, no network:
#
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# bench/gpu_check.py builds a Qwen2 of --shape 0.5b|3b|7b (default 0.5b; arguments pass through) in
# code and runs the worker's own wiring on CUDA: GRPO steps of 64 rows x 1,024 tokens in bf16 with
# micro-batches (step time, peak memory, MFU), the base's sleep through its pinned arena, 8 jobs
# trained one at a time (0.5B), pinned swaps against raw cudaMemcpy, a plain transformers + peft
# step of the same shape (the trainer/peer ratio), vLLM's parts where it imports, and a trainer engine
# of --trainer-width ranks (default 2; one per GPU, the widest the node has) beside one rank. It writes
# bench/results/gpu.json after each part (copied to $OUT), so a timeout keeps what ran; no part
# begins after --budget-s (420 s). The machine's python3 must have torch with CUDA, transformers,
# peft, safetensors; wheels it lacks (msgspec, pyzmq) travel in .whl/, excluded from
# git: `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl msgspec pyzmq`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p bench/results
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "gpu_check: installing .whl/ failed" >&2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > bench/results/nvidia-smi-gpu.txt 2>&1
[ -n "${OUT:-}" ] && cp -f bench/results/nvidia-smi-gpu.txt "$OUT"/ 2>/dev/null
"$PY" -c "import torch, msgspec; assert torch.cuda.is_available(), 'torch sees no GPU'" || {
  echo "gpu_check: needs torch with CUDA and msgspec (carry .whl)" >&2; exit 2; }
timeout 450 "$PY" bench/gpu_check.py --out bench/results/gpu.json "$@"
code=$?
[ -n "${OUT:-}" ] && cp -f bench/results/gpu.json "$OUT"/ 2>/dev/null
exit $code
