# Two entry points: `make demo` and `make test`. Both build .venv on first
# use; later runs reuse it and start within seconds.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0
# The stamp records that the package and its extras are installed for the
# current setup.cfg; editing setup.cfg re-runs the install.
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: the local CPU build; an unpinned torch would pull CUDA wheels.
	$(PIP) install --quiet $(TORCH_PIN)

# setup.py generates the gRPC stubs from protos/ and builds the C kernels at
# install time, so a changed .proto or kernel source re-runs the install too.
PROTOS := $(shell find protos -name '*.proto')
KERNEL := paramserver/shards/server/dynamic/kernel.c paramserver/optim/row_kernel.c paramserver/shards/server/row_store/row_log.c

$(STAMP): $(PY) setup.cfg setup.py pyproject.toml $(PROTOS) $(KERNEL)
	$(PIP) install --quiet $(TORCH_PIN) -e '.[test,s3,gcs,torchx]'
	touch $(STAMP)

# The main job on a local cluster: ps-server --shards 4, two ps-workers in one
# trainer group with the PowerSGD hook; ends with a one-line JSON summary.
demo: $(STAMP)
	$(VENV)/bin/ps-demo $(DEMO_ARGS)

# Test files run in TEST_WORKERS processes at once (pytest-xdist), each file's tests in one of them, in
# order (a file's shared fixtures start once); TEST_WORKERS=0 runs them all in this process.  Files are
# handed out in the order tests/conftest.py collects them (longest first), not by their number of tests.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# make bench also installs the bench extra (FBGEMM's CPU kernel, compared in optim_step.py's case (d)); where it
# does not install, the benchmarks run without that comparison. make test never installs it.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	if $(PIP) install --quiet $(TORCH_PIN) -e '.[bench]'; then touch $(BENCH_STAMP); \
	else echo "the bench extra did not install: optim_step.py runs without FBGEMM"; fi

bench: $(BENCH_STAMP)
	$(PY) benchmarks/optim_step.py
	$(PY) benchmarks/dist_optim.py
	$(PY) benchmarks/comm_hooks.py
	$(PY) benchmarks/end_to_end.py
	$(PY) benchmarks/staleness.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/dynamic_tables.py
	$(PY) benchmarks/data_reader.py
	$(PY) benchmarks/online_group.py
	$(PY) benchmarks/row_store.py

clean:
	rm -rf $(VENV) build *.egg-info
	find paramserver -name '*_pb2*.py*' -delete
	find paramserver -name '*.so' -delete
