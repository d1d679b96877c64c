# The two set-up commands of the README. Everything lives in .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Pinned: 2.13.0 is the CPU build available here; an unpinned torch pulls GBs of CUDA wheels.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.bfexp-installed

.PHONY: install run test docs docs-deps clean

# Bytecode: pip's own compiling of what it installs takes one core (torch's 10,000 modules: ~60 s); compileall
# takes them all. A module that is not Python 3.11 (torch ships one for 3.12's syntax) stays uncompiled, as pip
# leaves it; an editable install has none of bfexp's (see test: below).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --no-compile $(TORCH) -e '.[test]'
	$(PY) -m compileall -q -j 0 $(VENV)/lib bfexp > /dev/null 2>&1 || true
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/bfexp

# Four pytest workers, one test file each at a time (module fixtures stay whole). On 2 cores the CPU is
# never idle this way: a file that waits (a timeout, a signal's moment, one in-process interpreter) leaves its
# core to the others (measured here: 2 workers 15:57; 3 workers 11:42, 1.72 cores busy; 4 workers 10:40,
# 1.82 busy). tests/conftest.py hands the longest files out first.
WORKERS ?= 4

# Bytecode for bfexp and the tests first: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) no process writes it, and each of the suite's ranks and drivers compiled bfexp's modules again
# (0.6 s of CPU per process; only changed files are compiled here).
# PYTEST_ARGS: more of pytest's options (.ci/run leaves out the files it runs on the emulated cluster beside).
PYTEST_ARGS ?=
test: install
	$(PY) -m compileall -q bfexp tests scripts > /dev/null
	$(PY) -m pytest -q --durations=25 -n $(WORKERS) --dist loadfile -m "not soak and not large" $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml) into site/: the `docs` extra into .venv (docs-deps, once), the
# config reference regenerated from the code, then a strict build (a broken link or an unresolved API name
# fails it). Not part of `make test`; .ci/run runs both (docs-deps while the cluster comes up, the build
# beside the larger tests).
DOCS_STAMP := $(VENV)/.bfexp-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PIP) install -e '.[docs]'
	touch $(DOCS_STAMP)

docs-deps: $(DOCS_STAMP)

docs: docs-deps
	$(PY) scripts/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun site
