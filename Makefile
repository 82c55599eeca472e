# Two entry points (see README): `make repro` and `make test`. Both create .venv/ first if needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0

$(STAMP): requirements.txt pyproject.toml companion/pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements.txt
	$(VENV)/bin/python -m pip install -q --no-deps -e . -e ./companion
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

.PHONY: setup repro test
setup: $(STAMP)

repro: $(STAMP)
	. $(VENV)/bin/activate && dvc repro

test: $(STAMP)
	. $(VENV)/bin/activate && python -m pytest -q
