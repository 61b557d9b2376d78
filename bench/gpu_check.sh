#!/usr/bin/env bash
# The GPU checks of a lent machine, in one call of a few minutes (issue 6, "When a GPU is lent"):
#
#   1. bench/swap.py with a CUDA trainer: device<->host through TrainerEngine export/import
#      against pinned host<->device copies, host<->NVMe against raw file I/O, full sizes;
#   2. vLLM sleep mode on the tiny model: LLM(..., enable_sleep_mode=True), sleep(level=1),
#      wake_up(), timed, GPU memory freed, and the same greedy output after waking.
#
# Writes bench/results/swap-gpu.json and bench/results/vllm-sleep-gpu.json, and copies them
# (with nvidia-smi's view) to $OUT after each step when $OUT is set, so the device tool brings
# them back even if the call is cut short. Every step is bounded by `timeout`; a failed step does not stop the next; the exit
# code is non-zero if any step failed. It installs nothing heavy:
#   - the machine's python3 must have torch + transformers + peft (the 'cuda' image does);
#   - msgspec, which it lacks, travels as a wheel in .whl/ (see .library/device/README.md:
#     `echo /.whl/ >> .git/info/exclude`, `pip download ... msgspec`), carried as ".whl";
#   - vLLM's CUDA wheel is far over what a call may carry: without an importable vllm the
#     sleep/wake check writes {"skipped": why} instead of failing;
#   - carrying ".plexrl" (the tiny model built here) saves building it there.
# The steps' timeouts add up to 540 s, inside one call's 600 s limit:
#   run(command="bash bench/gpu_check.sh", carry=[".whl", ".plexrl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=bench/results
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
keep() {  # copy what exists so far to $OUT
  [ -n "${OUT:-}" ] && cp -f "$RESULTS"/swap-gpu.json "$RESULTS"/vllm-sleep-gpu.json "$RESULTS"/nvidia-smi-gpu.txt \
    "$OUT"/ 2>/dev/null
  return 0
}

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "gpu_check: installing .whl/ failed" >&2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$RESULTS/nvidia-smi-gpu.txt" 2>&1
"$PY" -c "import torch, msgspec; assert torch.cuda.is_available(), 'torch sees no GPU'" || {
  echo "gpu_check: needs torch with CUDA and msgspec (carry .whl)" >&2; keep; exit 2; }

echo "== tiny model"
timeout 120 "$PY" -m worker.tiny --root .plexrl --only tiny-arith >/dev/null || { echo "gpu_check: tiny model build failed" >&2; failed=1; }

echo "== swap (CUDA trainer, pinned copies)"
timeout 270 "$PY" bench/swap.py --out "$RESULTS/swap-gpu.json" || { echo "gpu_check: swap failed ($?)" >&2; failed=1; }
keep

echo "== vLLM sleep/wake"
timeout 150 "$PY" - "$RESULTS/vllm-sleep-gpu.json" <<'EOF' || { echo "gpu_check: vLLM sleep/wake failed ($?)" >&2; failed=1; }
import json, sys, time
from pathlib import Path

out_path, model = Path(sys.argv[1]), str(Path(".plexrl/models/tiny-arith").resolve())
result = {"model": model, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
try:
    import torch
    from vllm import LLM, SamplingParams
except ImportError as exc:
    result["skipped"] = f"vllm not importable here ({exc}); its CUDA wheel is too large to carry"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(result["skipped"])
    sys.exit(0)
prompts, greedy = ["3+5=", "2+2="], SamplingParams(temperature=0.0, max_tokens=4)
started = time.perf_counter()
llm = LLM(model=model, enable_sleep_mode=True, gpu_memory_utilization=0.3, max_model_len=64, enforce_eager=True,
          disable_log_stats=True)
result["load_s"] = time.perf_counter() - started
before = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
free_awake = torch.cuda.mem_get_info()[0]
started = time.perf_counter()
llm.sleep(level=1)
result["sleep_s"] = time.perf_counter() - started
result["freed_gib"] = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
started = time.perf_counter()
llm.wake_up()
result["wake_s"] = time.perf_counter() - started
after = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
result.update(vllm=__import__("vllm").__version__, before=before, after=after, same_output_after_wake=before == after)
out_path.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result))
EOF

keep
exit $failed
