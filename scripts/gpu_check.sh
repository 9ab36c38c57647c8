#!/usr/bin/env bash
# GPU path end to end, in a few minutes, printing the figures: run on a CUDA machine from the repo root.
#   bash scripts/gpu_check.sh            (uses .venv if present, else python3)
# Every attention mode, flash setting and cache strategy through `main.py run` on CUDA, with observed vs
# predicted KV, allocator and NVML figures; then the probe/sampler/snapshot checks.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp/kvscope-gpu-check}
mkdir -p "$OUT"
export KVSCOPE_CACHE=${KVSCOPE_CACHE:-$OUT/cache}
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not found"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda)"

# A real small model when it is in the local HF cache, else the embedded one.
MODEL=embedded
if $PY - <<'PY' 2>/dev/null; then MODEL=HuggingFaceTB/SmolLM2-135M; fi
from huggingface_hub import try_to_load_from_cache
import sys
sys.exit(0 if isinstance(try_to_load_from_cache("HuggingFaceTB/SmolLM2-135M", "config.json"), str) else 1)
PY
echo "model: $MODEL"

fail=0
run() {  # name, then run options
  local name=$1; shift
  echo "=== $name: $*"
  if HF_HUB_OFFLINE=1 timeout 240 $PY main.py run --model "$MODEL" --device cuda --tokens 48 \
       --record "$OUT/$name.jsonl" "$@" > "$OUT/$name.txt" 2>&1; then
    tail -n 4 "$OUT/$name.txt"
  else
    echo "FAILED ($?)"; tail -n 6 "$OUT/$name.txt"; fail=1
  fi
  rm -f "$OUT/$name.jsonl.tmp"
}
run modes --switch 8:attention=gqa:2 --switch 16:attention=mqa --switch 24:attention=window:32 \
          --switch 32:attention=mla --switch 40:attention=mha
run flash --attn-impl eager --switch 16:attn-impl=sdpa --switch 32:attn-impl=flash
run static --cache static --max-context 512
run quanto4 --cache quantized:4
run quanto2 --cache quantized:2
run hqq4 --cache quantized:hqq:4
run fp8 --cache quantized:fp8
run offloaded --cache offloaded
run strategies --switch 12:cache=static --switch 24:cache=quantized:4 --switch 36:cache=dynamic
run fp16 --dtype fp16 --switch 16:attention=mqa
run budget --memory-budget 64MiB --tokens 400 || true
[ -f scripts/gpu_probe_check.py ] && { echo "=== probes"; $PY scripts/gpu_probe_check.py --out "$OUT" || fail=1; }
# The window's way on CUDA: the model in the engine process (a spawned child that initialises CUDA
# itself), the 20 Hz sampler reading its allocator there, switches live; then the UI-thread figure.
echo "=== window (engine process) on CUDA"
if QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 timeout 240 $PY main.py --screenshot "$OUT/window-cuda.png" \
     --model "$MODEL" --device cuda --tokens 96 --switch 32:attention=gqa:2 --switch 64:attention=mqa \
     > "$OUT/window.txt" 2>&1; then tail -n 2 "$OUT/window.txt"; else echo "FAILED ($?)"; tail -n 6 "$OUT/window.txt"; fail=1; fi
QT_QPA_PLATFORM=offscreen timeout 240 $PY benchmarks/ui_stall.py --tokens 200 --engine process 2>&1 | grep -v propagateSizeHints | tail -n 2
echo "gpu_check: $([ $fail = 0 ] && echo OK || echo FAILURES) (outputs in $OUT)"
exit $fail
