# Two commands on a fresh machine: `make demo` and `make test`.
# The dev/CI environment pins torch==2.13.0 (a CPU wheel on local disk); the package
# itself only asks for torch>=2.4.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo demo-elastic test lint bench clean

$(STAMP): pyproject.toml Makefile constraints-dev.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[dev,examples,integrations]"
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_digits.py

# Fault tolerance: 3 replicas, one killed mid-backward, the others go on, it heals (examples/elastic_demo.py).
demo-elastic: $(STAMP)
	$(PY) examples/elastic_demo.py

# The import contracts of docs/architecture.md first (a second), then the tests.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) -m benchmarks iteration

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
