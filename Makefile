# `make train` and `make test` set up .venv themselves: it is (re)created when
# missing or broken, and reinstalled when pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The default job and the tests run on 8 simulated CPU devices.
CPU8   := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: train test venv clean

train: $(STAMP)
	$(CPU8) $(PY) scripts/train.py

test: $(STAMP)
	$(PY) -m pytest -q tests

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "zero_jax needs Python 3.11 or newer: run make PYTHON=python3.11 (or newer)"; exit 1; }
	@$(PY) -c 'import sys' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $@

clean:
	rm -rf $(VENV) build *.egg-info
