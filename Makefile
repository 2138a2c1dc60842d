# `make train` and `make test` set up .venv themselves: it is (re)created when
# missing or broken, and reinstalled when pyproject.toml or constraints.txt change.
# `make test-interop` does the same with .venv-interop, which adds transformers
# and a CPU build of torch, to check Hugging Face imports and exports.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
IVENV  := .venv-interop
ISTAMP := $(IVENV)/.installed
# torch 2.13.0 is the CPU build this project tests with.
INTEROP_PACKAGES := 'torch==2.13.0' 'transformers>=4.40'
CHECK_PYTHON = @$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "zero_jax needs Python 3.11 or newer: run make PYTHON=python3.11 (or newer)"; exit 1; }
# The tests compile hundreds of small programs, one compile per core at a
# time: one worker per core, each test file on one worker (its fixtures once).
TEST_WORKERS ?= 2

.PHONY: train test test-interop venv clean

# The default job runs on 8 simulated CPU devices (the tests: tests/conftest.py).
train: $(STAMP)
	$(PY) scripts/train.py --devices 8

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/interop

test-interop: $(ISTAMP)
	$(IVENV)/bin/python -m pytest -q tests/interop

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(CHECK_PYTHON)
	@$(PY) -c 'import sys' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $@

$(ISTAMP): pyproject.toml constraints.txt
	$(CHECK_PYTHON)
	@$(IVENV)/bin/python -c 'import sys' 2>/dev/null || { rm -rf $(IVENV) && $(PYTHON) -m venv $(IVENV); }
	$(IVENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	  -e '.[test]' $(INTEROP_PACKAGES)
	@touch $@

clean:
	rm -rf $(VENV) $(IVENV) build *.egg-info
