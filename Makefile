# dpexp developer commands. `make install` is safe to re-run: it only reinstalls when pyproject.toml changed.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpexp-installed

.PHONY: install test test-all test-durations lint bench bench-report tables figures reproduce audit

install: $(STAMP)

# The CUDA build of torch is installed first, pinned to the pair torchvision was built against; it also runs
# on CPU-only machines. Installing it before the package keeps pip from resolving another torch build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: install
	PY=$(PY) bash scripts/pytest_shards.sh

test-all: install
	PY=$(PY) bash scripts/pytest_shards.sh -m ""

# The default suite, each part merging its tests' durations into tests/durations.json, by which --shard
# balances the heavy tests over the parts (tests/sharding.py): rerun when tests have been added or moved.
test-durations: install
	PY=$(PY) bash scripts/pytest_shards.sh --record-durations

lint: install
	$(PY) -m ruff check .

bench: install
	$(PY) -m dpexp.bench

bench-report: install
	$(PY) scripts/bench_report.py

audit: install
	$(PY) -m dpexp.audit audit.save_to=results/audit/digits_white_box.json

# Every table and figure from the stored run records alone: the per-study tables of results/runs/<study>/
# and, for each experiment run under results/runs/<experiment>/<scale>/, its table in the paper's layout
# (results/tables/<experiment>_<scale>.{md,tex}) and figure (results/figures/); results/index.jsonl indexes
# every record.
tables: install
	$(PY) scripts/make_tables.py
	$(PY) -m dpexp.reproduce tables

figures: tables

# One published table: make reproduce EXPERIMENT=he2023_table11b SCALE=offline [LAUNCHER=basic|local|slurm]
# [ROWS=<row key>,... COLUMNS=<column key>,...: only those cells' runs] [WHERE=<key>=<value>,...: only the
# runs with those settings, e.g. WHERE=optim.lr=1e-3,seed=0] runs the runs of conf/experiment/$(EXPERIMENT).yaml not yet complete for this code, resumes interrupted
# ones, and renders the table (python -m dpexp.reproduce; an unknown name lists the valid ones).
EXPERIMENT ?=
SCALE ?= offline
LAUNCHER ?= basic
reproduce: install
	$(PY) -m dpexp.reproduce experiment=$(EXPERIMENT) scale=$(SCALE) launcher=$(LAUNCHER) \
		$(if $(ROWS),rows=$(ROWS)) $(if $(COLUMNS),columns=$(COLUMNS)) $(if $(WHERE),where=$(WHERE))
