# Two commands matter: `make demo` and `make test`. Both create .venv from requirements.lock
# (exact pins; torch==2.13.0 is the local CPU build) and install fq itself without touching the network again.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fq-installed

.PHONY: install test demo lint clean

install: $(STAMP)

# pip byte-compiles what it installs (26 of its 63 s here): with PYTHONDONTWRITEBYTECODE set, as on the dev machine,
# Python never caches what it compiles itself, and without pip's .pyc files every job recompiled torch on import
# (--no-compile made the suite 1.3x as long).
$(STAMP): requirements.lock pyproject.toml setup.py fq/codec/_trellis.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
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
