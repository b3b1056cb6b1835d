#!/usr/bin/env bash
# GPU check, from the repository root, on one CUDA GPU (sized for an H100/H200 with 16 cores,
# under 5 minutes):
#   1. the @pytest.mark.gpu tests (nvJPEG decoder, CUDA outputs, prefetcher, precision auto);
#   2. a loader-only bench: dali (nvJPEG, mixed), dali-cpudecode, torch, synthetic;
#   3. a train-mode bench: ResNet-50, bf16, channels_last, data-wait per backend.
# It prints one table last and writes $OUT_DIR/{loader,train}/bench.json.
#
# DALI: from the NVIDIA container, or a wheel file you carry: DALI_WHEEL=/path/to/
# nvidia_dali_cuda120-*.whl (or -cuda130 for a CUDA 13 torch), installed with --no-deps.
# Exit codes: 0 all tested and passed; 1 a test or run failed; 3 passed, but DALI was missing so
# its GPU path was NOT tested (REQUIRE_DALI=1 turns that into a failure before anything runs).
# DEVICE=cpu MODEL=small_cnn TRAIN_BATCH=8 dry-runs the script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT_DIR:-runs/gpu_check}
DATA=${DATA:-data/gpu_check}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-resnet50}
REQUIRE_DALI=${REQUIRE_DALI:-0}
TRAIN_BATCH=${TRAIN_BATCH:-128}   # a CPU dry run wants a small one, e.g. TRAIN_BATCH=8
say() { printf 'gpu_check: %s\n' "$*" >&2; }

if [ "$DEVICE" = cuda ]; then
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || { say "CUDA (or torch) is not available to $PY"; exit 1; }
  $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
fi
# A machine without network: carry the pure-Python dependencies as wheels (pip download -d DIR
# tomli-w tqdm) and point WHEELHOUSE at them.
if [ -n "${WHEELHOUSE:-}" ]; then
  $PY -m pip install -q --no-index --find-links "$WHEELHOUSE" tomli-w tqdm pillow numpy || exit 1
fi
$PY -c "import stallfree.cli, PIL, numpy, tqdm" 2>/dev/null || {
  say "stallfree's dependencies do not import with $PY (tomli-w, tqdm, pillow, numpy):"
  say "pip install them, or carry wheels and set WHEELHOUSE=/path/to/wheels"; exit 1; }
if [ -n "${DALI_WHEEL:-}" ]; then
  case "$(basename "$DALI_WHEEL")" in
    nvidia_dali_cuda1[23]0-*.whl) $PY -m pip install -q --no-deps "$DALI_WHEEL" || exit 1 ;;
    *) say "DALI_WHEEL=$DALI_WHEEL is not an nvidia_dali_cuda120/-cuda130 wheel"; exit 1 ;;
  esac
fi
if $PY -c "import nvidia.dali" 2>/dev/null; then
  dali=1; backends="dali,dali-cpudecode,torch,synthetic"
elif [ "$REQUIRE_DALI" = 1 ]; then
  say "REQUIRE_DALI=1 but nvidia.dali does not import: set DALI_WHEEL=/path/to/nvidia_dali_cuda*.whl"
  exit 1
else
  dali=0; backends="torch,synthetic"
  say "nvidia-dali is NOT installed: only torch and synthetic run; the DALI GPU path goes untested"
fi

status=0
if [ "$DEVICE" = cuda ]; then
  if $PY -c "import pytest" 2>/dev/null; then
    # -rs lists every skip: a gpu test skipped here is a check that did not happen.
    $PY -m pytest -q -rs -m gpu tests || status=1
  else
    say "pytest is not installed: the GPU unit tests did NOT run"; status=1
  fi
fi

cores=$($PY -c "import os; print(len(os.sched_getaffinity(0)))")
per_class=$(( cores >= 8 ? 40 : 10 ))
[ -f "$DATA/.complete" ] || $PY -m stallfree data demo "$DATA" --photo-like \
  --train-per-class "$per_class" --val-per-class 4 || exit 1
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
common=(--set "data.root=\"$DATA\"" --device "$DEVICE" --repeats 1 --warmup 5)
$PY -m stallfree bench pipelines/bench.toml --mode loader --backends "$backends" --batches 20 \
  "${common[@]}" --set train.batch_size=64 --out "$OUT_DIR/loader" > "$OUT_DIR/loader.log" 2>&1 \
  || { status=1; tail -5 "$OUT_DIR/loader.log"; }
$PY -m stallfree bench pipelines/bench.toml --mode train --backends "$backends" --batches 10 \
  "${common[@]}" --set "model.name=\"$MODEL\"" --set train.channels_last=true \
  --set train.batch_size="$TRAIN_BATCH" --out "$OUT_DIR/train" > "$OUT_DIR/train.log" 2>&1 \
  || { status=1; tail -5 "$OUT_DIR/train.log"; }
for mode in loader train; do
  [ -f "$OUT_DIR/$mode/bench.md" ] && grep -E '^\| (loader|train) ' "$OUT_DIR/$mode/bench.md"
  grep -A20 '^Failed runs' "$OUT_DIR/$mode/bench.md" 2>/dev/null && status=1
done
if [ "$status" = 0 ] && [ "$dali" = 0 ]; then
  say "passed WITHOUT DALI: exit 3 (install DALI or pass DALI_WHEEL to test its GPU path)"
  exit 3
fi
exit $status
