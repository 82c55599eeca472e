# Two entry points (see README): `make repro` and `make test`. Both create .venv/ first if needed.
# `make docs` builds the documentation site into site/ (mkdocs.yml; no pipeline stage runs).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0

$(STAMP): requirements.txt requirements-docs.txt requirements-nodeps.txt pyproject.toml companion/pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements.txt -r requirements-docs.txt
	$(VENV)/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(VENV)/bin/python -m pip install -q --no-deps -e . -e ./companion
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

.PHONY: setup repro test docs browser
setup: $(STAMP) browser

repro: $(STAMP)
	. $(VENV)/bin/activate && dvc repro

# two pytest-xdist workers (one torch thread each: tests/conftest.py), a file's tests in one worker, the
# files of the `slow` tests started first,
# the 25 slowest printed; the edit loop's fast tier: python -m pytest -q -m "not slow"
test: setup
	. $(VENV)/bin/activate && python -m pytest -q -n 2 --dist loadfile --durations=25

# The site: docs/gen_site.py (a mkdocs hook) lays out build/site_src/ from docs/ and the committed
# reports/, then mkdocs writes site/. Reads committed files only; runs no stage.
docs: setup
	mkdir -p build/site_src
	. $(VENV)/bin/activate && NO_MKDOCS_2_WARNING=1 mkdocs build --strict

# Debian's chromium for the site's browser test (tests/test_site.py): installed when missing, as
# root (CI runs as root); otherwise a one-line note, and that test skips saying chromium is absent.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "make browser: chromium is missing and this is not root with apt-get: install Debian's chromium for tests/test_site.py"; fi

# GPU checks (issues 17 and 25): issue 25's new paths on one GPU first — NCCL with one rank (FSDP2
# and DDP against the unwrapped model), LoRA on a bfloat16 base, MiniLM's cost per measure
# (benchmarks/gpu_check.py: torch, transformers and, when present, peft; a few minutes) — then the
# gpu-marked tests. Without CUDA: a one-line skip, exit 0. `make gpu-check-full` adds issue 17's
# benchmarks at the paper's sizes (longer).
GPU_PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python3)
.PHONY: gpu-check gpu-check-full
gpu-check:
	@if ! $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "gpu-check: skipped, no CUDA device visible to torch (nothing to check on this machine)"; \
	else \
		timeout 540 $(GPU_PY) -m benchmarks.gpu_check --json benchmarks/results/gpu_check.json && \
		if $(GPU_PY) -c "import pytest" 2>/dev/null; then \
			$(GPU_PY) -m pytest -q -m gpu tests/hideseek/test_gpu.py; \
		else echo "gpu-check: pytest not installed, the gpu-marked tests not run"; fi; \
	fi

gpu-check-full: gpu-check
	@if $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		$(GPU_PY) -m benchmarks.bench_sharpness --device cuda --models bert-base,vit-b32 --repeats 1 \
			--no-sync-count --projection no --json benchmarks/results/cuda.json \
			--markdown benchmarks/results/cuda.md && \
		$(GPU_PY) -m benchmarks.bench_memory --device cuda --models minilm-shape,bert-base \
			--measures floor,adaptive_l2,geodesic_mixed --batch-size 128 --seq-len 128 --n-iters 20 \
			--json benchmarks/results/memory_cuda.json --markdown benchmarks/results/memory_cuda.md; \
	fi

# The gpu profile in GPU-sized slices (issue 24 item 5): each call runs the next unfinished units of the MiniLM
# language zoo and the larger (timm) ViT zoo within GPU_BUDGET_S seconds, into GPU_OUT (state kept there;
# member weights are not). Needs only torch, transformers, timm, scipy, pandas, matplotlib on that machine;
# MiniLM from $HIDESEEK_MINILM_DIR (python -m companion.experiments.minilm export --out DIR).
GPU_OUT ?= reports/gpu_slices
GPU_BUDGET_S ?= 480
.PHONY: gpu-slices
gpu-slices:
	$(GPU_PY) -m companion.gpu_slices run --out $(GPU_OUT) --budget-s $(GPU_BUDGET_S)
