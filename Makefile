# Two commands on a fresh machine: `make demo` and `make test`.
# The dev/CI environment pins torch==2.13.0 (a CPU wheel on local disk); the package
# itself only asks for torch>=2.4.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo demo-elastic etcd test lint typecheck wheel-check bench clean

$(STAMP): pyproject.toml Makefile constraints-dev.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[dev,examples,integrations]"
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_digits.py

# Fault tolerance: 3 replicas, one killed mid-backward, the others go on, it heals (examples/elastic_demo.py).
# ETCD=1: the store is a local 3-member etcd cluster, and its leader is SIGKILLed mid-training too.
demo-elastic: $(STAMP) $(if $(ETCD),etcd)
	$(PY) examples/elastic_demo.py $(if $(ETCD),--etcd)

# etcd for the etcd store's tests and `make demo-elastic ETCD=1`: Debian's etcd-server unpacked into
# .etcd/ (apt-get download + dpkg -x; nothing installed system-wide). Never fails: where etcd cannot be
# had, the reason goes to .etcd/unavailable and the etcd tests skip with it (pytest -ra prints it).
etcd:
	@mkdir -p .etcd
	@if [ -x .etcd/usr/bin/etcd ] || command -v etcd >/dev/null 2>&1; then rm -f .etcd/unavailable; \
	elif (cd .etcd && { apt-get download etcd-server || { apt-get update -qq && apt-get download etcd-server; }; } \
	      && dpkg -x etcd-server_*.deb . && rm -f etcd-server_*.deb) >.etcd/fetch.log 2>&1 \
	      && [ -x .etcd/usr/bin/etcd ]; then rm -f .etcd/unavailable; echo "etcd: $$(.etcd/usr/bin/etcd --version | head -1)"; \
	else { echo "apt-get download etcd-server + dpkg -x failed:"; tail -n 3 .etcd/fetch.log; } >.etcd/unavailable; \
	     echo "etcd unavailable, the etcd tests will skip: $$(tr '\n' ' ' <.etcd/unavailable)"; fi

# The types (typecheck) and the wheel as users install it (wheel-check) first, then the import contracts of
# docs/architecture.md (a second), then the tests (etcd's need `make etcd`).
test: $(STAMP) etcd typecheck wheel-check
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

lint: $(STAMP) typecheck
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/lint-imports

# mypy, strict, over src/gradsync and tests/typing (pyproject.toml [tool.mypy]; why mypy: README "Type checking").
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# gradsync as users get it: the sdist and the wheel built and checked, installed with every extra into a fresh
# venv outside the checkout, and run there: the demo, GRADSYNC_INSTALL=1, python -m gradsync.run, DiLoCo, the
# fault-tolerant mode, mypy on a user's script (tests/wheel/check_wheel.py). Its mypy reuses typecheck's cache.
wheel-check: $(STAMP)
	$(PY) tests/wheel/check_wheel.py --python $(PYTHON)

bench: $(STAMP)
	$(PY) -m benchmarks iteration

clean:
	rm -rf $(VENV) .etcd build *.egg-info src/*.egg-info .mypy_cache
