#!/usr/bin/env bash
# Re-make assets/demo/demo.jsonl with the app itself: the embedded model and a scripted sequence
# MHA -> GQA(4) -> GQA(2) -> MQA, flash off -> on, dynamic -> static (prepaid to 1024 tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=assets/demo/demo.jsonl
rm -f "$out"
$PY main.py run --model embedded --device cpu --tokens 112 --attn-impl eager --max-context 1024 \
  --prompt "Context length is a prepayment of memory: every token keeps a key and a value in every layer. " \
  --switch 16:attention=gqa:4 --switch 32:attention=gqa:2 --switch 48:attention=mqa \
  --switch 64:attn-impl=flash --switch 80:cache=static --switch 96:attention=mha \
  --record "$out" > /dev/null
echo "wrote $out ($(wc -l < "$out") lines)"
