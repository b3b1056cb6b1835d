#!/usr/bin/env bash
# GPU check, from the repository root, on one CUDA GPU (sized for an H100/H200 with 16 cores,
# about 5 minutes), from a copied tree: nothing is built or downloaded.
#   0. `stallfree doctor`: torch, GPUs, DALI, nvImageCodec, nvjpeg, a one-image mixed decode;
#   1. the @pytest.mark.gpu tests (nvJPEG decoder, CUDA outputs, prefetcher, precision auto,
#      the mixed training graph: nvJPEG's ROI decode of the handed crop box, the handed flip,
#      RandAugment operations and erasing box, against the CPU graph's crops);
#   2. a loader-only bench: dali (nvJPEG, mixed), dali-cpudecode, torch, synthetic, and the
#      peers peer-pil and peer-torchvision (where torchvision imports);
#   2b. the same loader bench with RandAugment: dali (DALI's GPU operators) and torch;
#   3. a train-mode bench: ResNet-50, bf16, channels_last, data-wait per backend.
# It prints the tables last and writes $OUT_DIR/{loader,loader-randaugment,train}/bench.json.
#
# stallfree runs from src/ (PYTHONPATH), never installed. What the machine lacks comes in one of
# two ways, both without network:
#   DALI_SITE=DIR   a prepared site tree, put first on PYTHONPATH;
#   WHEELHOUSE=DIR  wheels installed in one `pip install --no-index --target` call into
#                   $OUT_DIR/site. Made on a machine with network by (for a CUDA 13 torch):
#     pip download -d wheelhouse --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 nvidia-dali-cuda130 nvidia-nvimgcodec-cu13 \
#         nvidia-nvjpeg optree gast astunparse tomli-w tqdm
#   (DALI finds libnvjpeg through nvImageCodec's $ORIGIN/../../cu13/lib: all in one tree.)
#   A CPU dry run's wheelhouse (tested: a venv with only torch, numpy and pillow, exit 0):
#     pip download -d wheelhouse tomli-w tqdm nvidia-dali-cuda120
# Exit codes: 0 all tested and passed; 1 a test or run failed; 3 passed, but DALI was missing so
# its GPU path was NOT tested (REQUIRE_DALI=1 makes that a failure first); 4 DALI's mixed decoder
# fell back to the CPU (nvjpeg did not load), so the "GPU" figures would be CPU decodes.
# DEVICE=cpu MODEL=small_cnn TRAIN_BATCH=8 dry-runs the script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-runs/gpu_check}
DATA=${DATA:-data/gpu_check}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-resnet50}
REQUIRE_DALI=${REQUIRE_DALI:-0}
TRAIN_BATCH=${TRAIN_BATCH:-128}   # a CPU dry run wants a small one, e.g. TRAIN_BATCH=8
LOADER_BATCH=${LOADER_BATCH:-64}
say() { printf 'gpu_check: %s\n' "$*" >&2; }

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
site=""
if [ -n "${WHEELHOUSE:-}" ]; then
  site="$(cd "$OUT_DIR" && pwd)/site"  # absolute, whether OUT_DIR is or not
  # One call into one tree: nvImageCodec must find nvjpeg beside it.
  wheels=$(find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' | sort)
  [ -n "$wheels" ] || { say "WHEELHOUSE=$WHEELHOUSE holds no .whl files"; exit 1; }
  # shellcheck disable=SC2086  # one argument per wheel
  $PY -m pip install -q --no-index --no-deps --target "$site" $wheels || {
    say "pip could not install the wheels of $WHEELHOUSE into $site"; exit 1; }
fi
export PYTHONPATH="$PWD/src${DALI_SITE:+:$DALI_SITE}${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"

# Never hidden: an import that fails prints its own error.
$PY -c "import stallfree.cli, torch, PIL, numpy, tqdm" || {
  say "stallfree or its dependencies (torch, pillow, numpy, tqdm) do not import with $PY: see"
  say "the error above; carry wheels (WHEELHOUSE=DIR) or a site tree (DALI_SITE=DIR)"; exit 1; }
$PY -m stallfree doctor | tee "$OUT_DIR/doctor.txt"
$PY -m stallfree doctor --json > "$OUT_DIR/doctor.json"
if [ "$DEVICE" = cuda ]; then
  grep -q '^OK    gpu' "$OUT_DIR/doctor.txt" || { say "no CUDA device (doctor's gpu line)"; exit 1; }
  if grep -q '^FAIL  mixed decode' "$OUT_DIR/doctor.txt"; then
    say "DALI's mixed decoder fell back to the CPU: exit 4 (see doctor's nvjpeg line)"; exit 4
  fi
fi
if $PY -c "import nvidia.dali"; then
  dali=1; backends="dali,dali-cpudecode,torch,synthetic"
elif [ "$REQUIRE_DALI" = 1 ]; then
  say "REQUIRE_DALI=1 but nvidia.dali does not import (the error above; doctor's dali line)"
  exit 1
else
  dali=0; backends="torch,synthetic"
  say "nvidia-dali does not import: only torch and synthetic run; the DALI GPU path goes untested"
fi
# The loaders people would pick instead, on the same files: a plain DataLoader with PIL, and
# torchvision's decode + transforms v2 where torchvision imports (the NVIDIA container).
backends="$backends,peer-pil"
if $PY -c "import torchvision.io, torchvision.transforms.v2" 2>/dev/null; then
  backends="$backends,peer-torchvision"
fi

status=0
if [ "$DEVICE" = cuda ]; then
  if $PY -c "import pytest" 2>/dev/null; then
    # -rs lists every skip: a gpu test skipped here is a check that did not happen.
    # Only the modules that hold gpu tests: collecting the rest would import what only the
    # CPU test machine has (store servers, webdataset), and a collection error fails the check.
    # shellcheck disable=SC2046  # one argument per file
    $PY -m pytest -q -rs -p no:cacheprovider -m gpu $(grep -rl 'mark\.gpu' tests/unit tests/e2e) \
      || status=1
  else
    say "pytest is not installed: the GPU unit tests did NOT run"; status=1
  fi
fi

# Data: 200 real photo-like JPEGs (+ val), and a train split of hard links to them, large enough
# that no timed window crosses an epoch end (a DALI pipeline rebuild would land inside it).
need=$(( (5 + 20) * LOADER_BATCH > (3 + 10) * TRAIN_BATCH ? (5 + 20) * LOADER_BATCH : (3 + 10) * TRAIN_BATCH ))
need=$(( need * 2 ))
if [ ! -f "$DATA/.complete-$need" ]; then
  rm -rf "$DATA" "$DATA.src"
  $PY -m stallfree data demo "$DATA.src" --photo-like --train-per-class 20 --val-per-class 4 \
    --no-progress || exit 1
  mkdir -p "$DATA"
  cp -r "$DATA.src/val" "$DATA/val"
  $PY - "$DATA.src/train" "$DATA/train" "$need" <<'EOF' || exit 1
import os, sys
from pathlib import Path
src, dst, need = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
files = sorted(src.glob("*/*.jpg"))
for i in range(need):
    f = files[i % len(files)]
    (dst / f.parent.name).mkdir(parents=True, exist_ok=True)
    os.link(f, dst / f.parent.name / f"{i:07d}.jpg")
EOF
  touch "$DATA/.complete-$need"
fi
common=(--set "data.root=\"$DATA\"" --device "$DEVICE" --repeats 1 --warmup 5 --no-progress)
$PY -m stallfree bench pipelines/bench.toml --mode loader --backends "$backends" --batches 20 \
  "${common[@]}" --set train.batch_size="$LOADER_BATCH" --out "$OUT_DIR/loader" \
  > "$OUT_DIR/loader.log" 2>&1 || { status=1; tail -5 "$OUT_DIR/loader.log"; }
# RandAugment where DALI means it to run (its GPU operators) and in the torch workers.
policy_backends=$([ "$dali" = 1 ] && echo "dali,torch" || echo "torch")
$PY -m stallfree bench pipelines/bench.toml --mode loader --backends "$policy_backends" \
  --batches 20 "${common[@]}" --set train.batch_size="$LOADER_BATCH" \
  --set 'augment.auto_augment="randaugment"' --out "$OUT_DIR/loader-randaugment" \
  > "$OUT_DIR/loader-randaugment.log" 2>&1 || { status=1; tail -5 "$OUT_DIR/loader-randaugment.log"; }
$PY -m stallfree bench pipelines/bench.toml --mode train --backends "$backends" --batches 10 \
  "${common[@]}" --warmup 3 --set "model.name=\"$MODEL\"" --set train.channels_last=true \
  --set train.batch_size="$TRAIN_BATCH" --out "$OUT_DIR/train" > "$OUT_DIR/train.log" 2>&1 \
  || { status=1; tail -5 "$OUT_DIR/train.log"; }
for mode in loader loader-randaugment train; do
  [ -f "$OUT_DIR/$mode/bench.md" ] && grep -E '^(Recipe|\| (loader|train) )' "$OUT_DIR/$mode/bench.md"
  grep -A20 '^Warnings from runs' "$OUT_DIR/$mode/bench.md" 2>/dev/null
  grep -A20 '^Failed runs' "$OUT_DIR/$mode/bench.md" 2>/dev/null && status=1
done
if [ "$DEVICE" = cuda ] && grep -qi 'nvjpeg' "$OUT_DIR"/*/bench.md 2>/dev/null; then
  say "a bench run warned about nvjpeg: its dali figures may be CPU decodes: exit 4"; exit 4
fi
if [ "$status" = 0 ] && [ "$dali" = 0 ]; then
  say "passed WITHOUT DALI: exit 3 (carry DALI in WHEELHOUSE or DALI_SITE to test its GPU path)"
  exit 3
fi
exit $status
