#!/usr/bin/env bash
# GPU check, on a CUDA machine, from the repository root, in under 5 minutes:
#   1. the @pytest.mark.gpu tests (mixed decoder, CUDA outputs, dtypes) when pytest is there;
#   2. a short dali vs torch vs synthetic comparison, printed as a table.
# DALI is optional: without it the torch and synthetic checks still run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT_DIR:-runs/gpu_check}
DATA=${DATA:-data/gpu_check}
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu MODELS=small_cnn dry-runs the script without a GPU
MODELS=${MODELS:-small_cnn resnet50}

if [ "$DEVICE" = cuda ]; then
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || { echo "gpu_check: CUDA (or torch) is not available to $PY" >&2; exit 1; }
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
fi
if $PY -c "import nvidia.dali" 2>/dev/null; then backends="dali torch synthetic"; else
  echo "gpu_check: nvidia-dali not installed; running torch and synthetic only"; backends="torch synthetic"; fi

status=0
if [ "$DEVICE" = cuda ] && $PY -c "import pytest" 2>/dev/null; then
  $PY -m pytest -q -m gpu tests || status=1
elif [ "$DEVICE" = cuda ]; then
  echo "gpu_check: pytest not installed; skipping the GPU unit tests"
fi

[ -f "$DATA/.complete" ] || $PY -m stallfree data demo "$DATA" --train-per-class 100 --val-per-class 20
rm -rf "$OUT_DIR"
for model in $MODELS; do
  if [ "$model" = resnet50 ]; then
    extra=(--set augment.image_size=224 --set augment.resize_size=256 --set train.batch_size=128
           --set train.channels_last=true --set optim.lr=0.001)
  else extra=(); fi
  for b in $backends; do
    $PY -m stallfree train pipelines/demo.toml --loader "$b" --device "$DEVICE" --epochs 2 --no-progress \
      --set data.root=\""$DATA"\" --set model.name=\""$model"\" "${extra[@]}" \
      --out "$OUT_DIR/$model-$b" || status=1
  done
done
$PY -m stallfree compare "$OUT_DIR"/*
exit $status
