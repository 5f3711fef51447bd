# Two commands matter: `make demo` and `make test`. Both create .venv from requirements.lock
# (exact pins; torch==2.13.0 is the local CPU build) and install fq itself without touching the network again.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fq-installed

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml setup.py fq/codec/_trellis.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(PY) -m fq.demo_codec

clean:
	rm -rf $(VENV) build *.egg-info fq/codec/*.so
