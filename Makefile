# Two commands for a fresh machine with Python 3.11: `make demo` runs the main job, `make test`
# runs the suite. Both create (or reuse) the virtual environment `.venv` by themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-core
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-bench

.PHONY: demo test test-fast test-exhaustive bench bench-demo venv bench-venv device-wheels device-rehearse \
	device-rehearse-all

$(STAMP): setup.py
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# The main job: train ListOps (generated data, CPU-sized model) and report test accuracy.
demo: $(STAMP)
	$(VENV)/bin/lra run listops --size small

# A short run of the attention benchmark (JAX implementations; torch peers when installed).
bench-demo: $(STAMP)
	$(VENV)/bin/python benchmarks/attention.py --demo

# The suite on up to 4 cores (pytest-xdist), one test file per worker: a file's tests share its
# fixtures (trained runs, generated data) and run in order. A test still running after 20 minutes
# has hung: pytest-timeout prints every thread's stack and ends its worker. A worker that ended
# is not replaced (xdist would run the same test again on the new one, file by file), so the
# suite finishes with that test failed.
PYTEST := $(VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile \
	--timeout 1200 --timeout-method thread --max-worker-restart 0
test: $(STAMP)
	$(PYTEST) tests

# The same without the end-to-end tests marked `slow` (training runs, the command in
# subprocesses, multi-process runs, fault soaks): the quick check while developing.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# Everything, the exhaustive tier too (`exhaustive`: further shapes, kinds and sizes of paths the
# default suite already takes; docs/testing.md).
test-exhaustive: $(STAMP)
	LRA_TEST_EXHAUSTIVE=1 $(PYTEST) tests

# The first hour scripted: the README's main job and every doc command that states a number, from
# a fresh clone, each compared with its doc (benchmarks/first_hour.py; ~25 min, QUICK=1: ~1 min).
.PHONY: first-hour
first-hour: $(STAMP)
	$(VENV)/bin/python benchmarks/first_hour.py $(if $(QUICK),--quick)

# Benchmarks against PyTorch and Hugging Face need the `bench` extra, kept in its own venv.
$(BENCH_STAMP): setup.py
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -e '.[test,bench]'
	@touch $(BENCH_STAMP)

bench-venv: $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/attention.py

# Wheels of what the GPU machine lacks (tensorflow-datasets, grain, tokamax, ...), for
# benchmarks/device_check.py; into the git-ignored device-wheels/cp$(PYTHON_TAG)/ with a manifest.
# PYTHON_TAG=312 for the GPU machine (default), PYTHON_TAG=311 for the rehearsal here.
PYTHON_TAG ?= 312
device-wheels: $(STAMP)
	$(VENV)/bin/python benchmarks/device_wheels.py --python-tag $(PYTHON_TAG)

# The device check's rehearsal: the one command of a short lease (`lease`: env, the H100's
# failing test files, the target points of speed, ListOps with dense attention) at toy sizes on
# this CPU, from a fresh virtual environment built like the GPU machine's, with the wheels staged
# for this Python; `make device-rehearse-all` rehearses every part instead.
device-rehearse: $(STAMP)
	$(MAKE) device-wheels PYTHON_TAG=$$($(VENV)/bin/python -c 'import sys; print("%d%d" % sys.version_info[:2])')
	$(VENV)/bin/python benchmarks/device_check.py lease --out $${TMPDIR:-/tmp}/device-rehearsal --rehearse

device-rehearse-all: $(STAMP)
	$(MAKE) device-wheels PYTHON_TAG=$$($(VENV)/bin/python -c 'import sys; print("%d%d" % sys.version_info[:2])')
	$(VENV)/bin/python benchmarks/device_check.py all --out $${TMPDIR:-/tmp}/device-rehearsal-all --rehearse

# Mutation testing of one module with the tests mapped to it in benchmarks/mutation.py
# (cosmic-ray, in a private copy of the work tree; minutes per module, not part of CI):
# `make mutation MODULE=attention/band.py`. Scores and equivalent survivors: docs/testing.md.
.PHONY: mutation
MODULE ?= attention/band.py
mutation: $(STAMP)
	@$(VENV)/bin/python -c 'import cosmic_ray' 2>/dev/null || \
	  $(VENV)/bin/python -m pip install -q 'cosmic-ray==8.7.0'
	nice -n 19 $(VENV)/bin/python benchmarks/mutation.py $(MODULE)
