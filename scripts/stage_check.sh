#!/usr/bin/env bash
# Drive the real window the way a speaker does, on a real X server (Xvfb + openbox), and save what a
# projector would show. Needs: apt-get install -y xvfb openbox xdotool imagemagick.
#
#   scripts/stage_check.sh [OUT_DIR] [WxH ...]      (default: stage-shots/, 1024x768 1280x720 1920x1080)
#   STAGE_MODEL=DIR scripts/stage_check.sh ...       the window's run on that model (a real pretrained folder, a
#                                                    GGUF: STAGE_MODEL=x.gguf STAGE_RUNTIME=llama.cpp) instead of
#                                                    the embedded one, with STAGE_TOKENS new tokens (default 4000: a static cache of the
#                                                    embedded model's 4,096 positions still holds the run)
#   STAGE_FRESH=1 scripts/stage_check.sh ...         also the first quantized cache on a fresh build (minutes)
#   STAGE_RERUN=1 scripts/stage_check.sh ...         also the longest token gap around a re-run, before/after
#                                                    (benchmarks/rerun_gap.py: MLA and h2o at tokens 100, 500, 2,000)
#
# Per screen size: time from launch to the window being mapped; then keys 1-5 (attention modes), F
# (flash), C (cache), Space twice (pause, resume), F11 (presenter) and back, the calculator tab,
# the File and Run menus, the light theme (window and presenter mode), and Ctrl+Q (quit, timed). A PNG after each step in OUT_DIR/<size>/; look at every one.
# Then, on the first size's display: per-key latency (key to the switch shown) and the longest token gap
# during a 30-key mash (benchmarks/stage_keys.py), --screenshot --size 1024x768 normal and presenter (the
# PNG must be 1024x768), start-up at idle (benchmarks/startup.py), and with STAGE_FRESH=1 the first
# quantized switch with optimum-quanto's extension built afresh (benchmarks/fresh_quantized.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-stage-shots}
shift || true
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1024x768 1280x720 1920x1080)
PY=${PY:-.venv/bin/python}
for tool in Xvfb openbox xdotool import; do
  command -v "$tool" >/dev/null || { echo "stage_check: $tool is missing (apt-get install -y xvfb openbox xdotool imagemagick)"; exit 2; }
done

# KVSCOPE_CACHE as set (default: the user cache, where the embedded model is usually built already)
CONFIG=$(mktemp -d)  # the window's remembered settings: fresh for every size, never the user's
trap 'rm -rf "$CONFIG"' EXIT

shot() {  # shot NAME: the whole screen, as the audience sees it
  import -display "$DISPLAY" -window root "$DIR/$1.png"
  echo "  $DIR/$1.png"
}

key() {  # key KEYSPEC [SECONDS]: press a key in the window (found afresh: full screen may remap it)
  WID=$(xdotool search --onlyvisible --name "^KV Scope" | head -1)
  xdotool windowactivate "$WID" 2>/dev/null || true
  xdotool key --clearmodifiers "$1"
  sleep "${2:-2}"
}

for size in "${SIZES[@]}"; do
  DIR="$OUT/$size"
  mkdir -p "$DIR"
  export DISPLAY=:97
  Xvfb "$DISPLAY" -screen 0 "${size}x24" -nolisten tcp >/dev/null 2>&1 &
  XVFB=$!
  sleep 1
  openbox >/dev/null 2>&1 &
  WM=$!
  sleep 1
  echo "== $size"
  start=$(date +%s.%N)
  MODEL_ARGS=()
  [ -n "${STAGE_MODEL:-}" ] && MODEL_ARGS=(--model "$STAGE_MODEL")
  [ -n "${STAGE_RUNTIME:-}" ] && MODEL_ARGS+=(--runtime "$STAGE_RUNTIME")
  XDG_CONFIG_HOME="$CONFIG/$size" "$PY" main.py --tokens "${STAGE_TOKENS:-4000}" "${MODEL_ARGS[@]}" \
    >"$DIR/app.log" 2>&1 &
  APP=$!
  WID=$(xdotool search --sync --onlyvisible --name "^KV Scope" | head -1)
  shown=$(date +%s.%N)
  printf '  window mapped after %.2f s\n' "$(echo "$shown - $start" | bc)"
  xdotool windowactivate --sync "$WID" 2>/dev/null || true
  xdotool key --window "$WID" super+Up 2>/dev/null || true  # maximise, as on a projector
  sleep 25  # the engine loads the model and the run starts
  echo "  window geometry: $(xdotool getwindowgeometry "$WID" | tr '\n' ' ' | sed 's/  */ /g')"
  shot 01-running
  for n in 1 2 3 4 5; do key "$n" 4; shot "02-key-$n"; done
  key f 4; shot 03-flash
  key c 4; shot 04-cache
  key space 2; shot 05-paused
  key space 2
  key F11 4; shot 06-presenter
  key F11 3; shot 07-presenter-left
  key ctrl+Tab 3; shot 08-calculator
  key ctrl+shift+Tab 1
  key alt+f 1; shot 09-file-menu
  key Escape 1
  key alt+r 1; shot 10-run-menu
  key Escape 1
  key alt+v 1; key l 3; shot 11-light-theme  # View > Light theme (its mnemonic)
  key F11 4; shot 12-light-presenter
  key F11 3
  key alt+v 1; key d 2  # back to dark
  quit_start=$(date +%s.%N)
  xdotool key --clearmodifiers ctrl+q || true
  for _ in $(seq 1 100); do kill -0 "$APP" 2>/dev/null || break; sleep 0.1; done
  quit_end=$(date +%s.%N)
  if kill -0 "$APP" 2>/dev/null; then echo "  still running 10 s after Ctrl+Q"; kill "$APP"; fi
  printf '  quit (Ctrl+Q) took %.2f s\n' "$(echo "$quit_end - $quit_start" | bc)"
  kill "$WM" "$XVFB" 2>/dev/null || true
  wait "$XVFB" 2>/dev/null || true
done

# ---- figures (issue 25, item 7)
echo "== figures"
export DISPLAY=:97
Xvfb "$DISPLAY" -screen 0 "${SIZES[0]}x24" -nolisten tcp >/dev/null 2>&1 &
XVFB=$!
sleep 1
openbox >/dev/null 2>&1 &
WM=$!
sleep 1
XDG_CONFIG_HOME="$CONFIG/keys" "$PY" benchmarks/stage_keys.py 2>&1 | grep -E "^(key|30-key|\{)" | sed 's/^/  /' || true
kill "$WM" "$XVFB" 2>/dev/null || true
wait "$XVFB" 2>/dev/null || true
for mode in normal presenter; do
  extra=()
  [ "$mode" = presenter ] && extra=(--presenter)
  QT_QPA_PLATFORM=offscreen "$PY" main.py --screenshot "$OUT/screenshot-1024x768-$mode.png" --size 1024x768 \
    --tokens 120 --force "${extra[@]}" --switch 40:attention=mqa --switch 40:cache=static \
    --switch 80:attention=window:256 >/dev/null 2>&1 || true
  echo "  --screenshot --size 1024x768 $mode: $(identify -format '%wx%h' "$OUT/screenshot-1024x768-$mode.png" 2>/dev/null || echo missing)"
done
"$PY" benchmarks/startup.py --repeats 1 2>&1 | sed 's/^/  /' || true
if [ "${STAGE_RERUN:-0}" = 1 ]; then
  "$PY" benchmarks/rerun_gap.py 2>&1 | grep -v "^USDT" | sed 's/^/  /' || true
fi
if [ "${STAGE_FRESH:-0}" = 1 ]; then
  "$PY" benchmarks/fresh_quantized.py 2>&1 | grep -v "^USDT" | sed 's/^/  /' || true
fi
