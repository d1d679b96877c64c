# The two set-up commands of the README. Everything lives in .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Pinned: 2.13.0 is the CPU build available here; an unpinned torch pulls GBs of CUDA wheels.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.bfexp-installed

.PHONY: install run test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/bfexp

# Two pytest workers, one test file each at a time (module fixtures stay whole): the suite mostly
# waits on ranks it spawns, so two files share the machine's cores (13.6 -> 10 min on 2 cores).
WORKERS ?= 2

test: install
	$(PY) -m pytest -q --durations=25 -n $(WORKERS) --dist loadfile -m "not soak and not large"

clean:
	rm -rf $(VENV) outputs multirun
