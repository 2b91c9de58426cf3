# dpexp developer commands. `make install` is safe to re-run: it only reinstalls when pyproject.toml changed.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpexp-installed

.PHONY: install test test-all lint bench bench-report tables audit

install: $(STAMP)

# The CUDA build of torch is installed first, pinned to the pair torchvision was built against; it also runs
# on CPU-only machines. Installing it before the package keeps pip from resolving another torch build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m ""

lint: install
	$(PY) -m ruff check .

bench: install
	$(PY) -m dpexp.bench

bench-report: install
	$(PY) scripts/bench_report.py

audit: install
	$(PY) -m dpexp.audit audit.save_to=results/audit/digits_white_box.json

tables: install
	$(PY) scripts/make_tables.py
