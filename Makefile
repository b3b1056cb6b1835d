# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install stallfree into it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stallfree-installed
DEMO   := data/demo
# torch==2.13.0 is installed first only when no torch is present: a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build; inside the NVIDIA container its own torch is kept.
TORCH_PIN ?= torch==2.13.0
# tb: TensorBoard's tb/ in every run directory (tensorboard, grpcio, its data server: ~50 MB installed).
# lightning: the Lightning example and its test (lightning, torchmetrics, aiohttp: ~35 MB; never a torch).
# onnx: export's model.onnx and its test (onnx, onnxscript, onnxruntime: ~120 MB; never a torch).
EXTRAS ?= test,plot,dali,fast,track,tb,s3,lightning,onnx

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml Makefile  # a new extra here reaches an existing .venv
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# mypy's cache of torch's own types (~30 s, once a checkout), for `make lint` and the suite
	-$(PY) -m mypy >/dev/null 2>&1
	touch $(STAMP)

# Both end by saying how to put `stallfree` on PATH: the README's commands assume it.
ACTIVATE := @echo "stallfree is installed in $(VENV)/bin; put it on PATH with: source $(VENV)/bin/activate"

install: $(STAMP)
	$(ACTIVATE)

$(DEMO)/.complete: | $(STAMP)
	$(VENV)/bin/stallfree data demo $(DEMO)

demo: $(STAMP) $(DEMO)/.complete
	@echo "make demo: 20 epochs with dali, then with torch; about 5 min on 2 cores without native bf16"
	rm -rf runs/demo-dali runs/demo-torch  # a run directory belongs to one run: start both afresh
	$(VENV)/bin/stallfree train pipelines/demo.toml --loader dali --out runs/demo-dali
	$(VENV)/bin/stallfree train pipelines/demo.toml --loader torch --out runs/demo-torch
	$(VENV)/bin/stallfree compare runs/demo-dali runs/demo-torch
	$(ACTIVATE)

# Azurite (Azure Blob Storage's emulator, a node program) for the az:// tests, from npm into
# tests/.node. Without node or npm the install fails, ignored: those tests then say why.
AZURITE ?= azurite@3.35.0
tests/.node/node_modules/.bin/azurite-blob:
	-npm install --silent --no-audit --no-fund --prefix tests/.node $(AZURITE)

# One pytest worker per core; worksteal evens out the few long end-to-end tests.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: $(STAMP) tests/.node/node_modules/.bin/azurite-blob
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# What tests/e2e/test_style_runs.py checks, alone and in seconds (.pre-commit-config.yaml runs the same).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(DEMO) runs
