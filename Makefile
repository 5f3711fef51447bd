# Two commands matter: `make demo` and `make test`. Both create .venv from requirements.lock
# (exact pins; torch==2.13.0 is the local CPU build) and install fq itself without touching the network again.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fq-installed

.PHONY: install test demo lint clean

install: $(STAMP)

# The lock is installed by uv, pinned here and fetched from PyPI like every pin of the lock: its downloads run in
# parallel (at a load near 2 here: pip 73-89 s, uv about 45 s from an empty cache; docs/testing.md: both under load).
# No fallback to pip: uv comes from the same registry as the lock, and one installer keeps the install one thing.
# --compile-bytecode: with PYTHONDONTWRITEBYTECODE set, as on the dev machine, Python never caches what it compiles
# itself, and without these .pyc files every job recompiled torch on import (--no-compile made the suite 1.3x as long).
# uv reads no pip.conf: it gets the find-links pip is configured with (PIP_FIND_LINKS or pip.conf), which is where
# this machine kind keeps its CPU build of torch 2.13.0 (the lock's torch==2.13.0 matches 2.13.0+cpu, which both
# installers prefer to PyPI's 2.13.0); without find-links both take PyPI's build.
UV_VERSION := 0.13.8
UV := $(VENV)/bin/uv
# pip's own reading of its configuration: the find-links it would use
PIP_LINKS := from pip._internal.commands import create_command as c; print(*("--find-links=" + u for u in c("install").parse_args([])[0].find_links))
$(STAMP): requirements.lock pyproject.toml setup.py fq/codec/_trellis.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) pip install -q --python $(PY) --compile-bytecode $$($(PY) -c '$(PIP_LINKS)') -r requirements.lock
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Two workers (pytest-xdist), one test module each at a time: CI has 2 cores, and a module's campaign fixture is
# built once, on the worker that runs the module. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The main job: the Snakemake campaign on the embedded demo model (config/config.yaml), end to end,
# then what a consumer does (fq verify with the pinned key), then the Snakemake report.
DEMO_OUT := results/demo
# Two runs: a recipe with a budgeted base (demo: b3) has its allocation measured by the first (sensitivity ->
# allocate), which the second plans its encode jobs from; with nothing pending the second finds nothing to do.
demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/snakemake --cores $(shell nproc)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/snakemake --cores $(shell nproc)
	$(VENV)/bin/fq verify $(DEMO_OUT)/published --key $(DEMO_OUT)/signer.pub
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/snakemake --cores 1 --report $(DEMO_OUT)/report.html
	@echo
	@echo "products (signed):   $(DEMO_OUT)/published   (assemblies in $(DEMO_OUT)/published/assemblies)"
	@echo "summary:             $(DEMO_OUT)/campaign_summary.json"
	@echo "report:              $(DEMO_OUT)/report.html  (tables and plots also in $(DEMO_OUT)/report/)"
	@echo "output quality:      $(DEMO_OUT)/eval/eval.tsv  (fq eval: KL, perplexity, top-1 against the source; docs/eval.md)"
	@echo "verify it yourself:  $(VENV)/bin/fq verify $(DEMO_OUT)/published --key $(DEMO_OUT)/signer.pub"

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint

clean:
	rm -rf $(VENV) build *.egg-info fq/codec/*.so
