# The two set-up commands of the README. Everything lives in .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Pinned: 2.13.0 is the CPU build available here; an unpinned torch pulls GBs of CUDA wheels.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.bfexp-installed

.PHONY: install run test docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH) -e '.[test]'
	$(PY) -m compileall -q bfexp > /dev/null  # an editable install has none; see test: below
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/bfexp

# Three pytest workers, one test file each at a time (module fixtures stay whole). On 2 cores the CPU
# is never idle this way: a file that waits (a timeout, a signal's moment, one in-process interpreter) leaves
# its core to the other two (measured: 2 workers 15:57, 1.81 cores busy; 3 workers 13:17, 1.94 busy).
# tests/conftest.py hands the longest files out first.
WORKERS ?= 3

# Bytecode for bfexp and the tests first: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) no process writes it, and each of the suite's ranks and drivers compiled bfexp's modules again
# (0.6 s of CPU per process; only changed files are compiled here).
test: install
	$(PY) -m compileall -q bfexp tests scripts > /dev/null
	$(PY) -m pytest -q --durations=25 -n $(WORKERS) --dist loadfile -m "not soak and not large"

# The documentation site (docs/, mkdocs.yml) into site/: the `docs` extra into .venv, the config reference
# regenerated from the code, then a strict build (a broken link or an unresolved API name fails it).
# Not part of `make test`; .ci/run runs both.
docs: install
	$(PIP) install -e '.[docs]'
	$(PY) scripts/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun site
