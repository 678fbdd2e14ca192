# Two entry points for a newcomer: `make serve` and `make test`.
# Both create .venv on first use. torch==2.13.0 goes in first, because on a machine without
# torch a bare `torch` requirement pulls a multi-GB CUDA build; GPU users keep their own torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv clean system-deps

# The venv and the system packages (system-deps, below) install side by side.
MAKEFLAGS += --jobs=2
# Nothing compiles the dependencies ahead (the installers leave bytecode out): the first process
# that imports a module writes its bytecode and later ones read it, so only what runs is compiled
# (docs/BENCHMARKS.md, the make test row). Where PYTHONDONTWRITEBYTECODE is set, every process
# the suite starts would compile torch again: it is not passed on.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

# uv resolves and fetches the project's hundred-odd dependencies in parallel, where pip takes
# them one at a time (the same versions; docs/BENCHMARKS.md, the make test row). pip still installs
# torch, since only pip reads the local wheel that pip.conf's find-links name, and takes over
# wherever uv fails.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]' \
		|| $(PY) -m pip install -q --no-compile -e '.[dev]'
	@touch $(STAMP)

serve: $(STAMP)
	$(PY) -m trtdisagg up

lint: $(STAMP)
	$(PY) -m ruff check trtdisagg tests tools
	$(PY) -m mypy

# The membership tests run a real etcd and put hosts in network namespaces (ip netns). On a
# fresh Debian machine (CI runs as root) the two are installed from Debian's packages, and
# only when missing, so `make test` on a prepared machine touches nothing.
system-deps:
	@command -v etcd >/dev/null && command -v ip >/dev/null || { \
		echo "installing etcd-server and iproute2 (apt-get)"; \
		SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q etcd-server iproute2; }

# The suite runs on TEST_WORKERS xdist workers: run one at a time, its tests leave a core idle
# while they wait on timeouts, child processes and start-ups. Each test file stays on one worker,
# so a module's cluster starts once; tests/conftest.py hands the slow modules out first and
# spreads the waiting (integration) modules among the busy (unit) ones.
TEST_WORKERS ?= 2

# compileall: the project's own modules compiled once on both cores, not by each of the suite's
# first processes at the same time. mypy (one core) runs beside the suite, which leaves a core
# idle much of the time; its report follows the suite's, and either one failing fails `make test`.
test: $(STAMP) system-deps
	$(PY) -m ruff check trtdisagg tests tools
	$(PY) -m compileall -q -j 0 trtdisagg tests tools
	@$(PY) -m mypy > $(VENV)/mypy.out 2>&1 & types=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -m "not gpu" --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; suite=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.out; \
	test $$suite = 0 && test $$typed = 0

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache
