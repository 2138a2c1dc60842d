# `make train` and `make test` set up .venv themselves: it is (re)created when
# missing, broken or made by another interpreter than $(PYTHON), and
# reinstalled when pyproject.toml or constraints.txt change.
# `make test-interop` does the same with .venv-interop, which adds transformers
# and torch, to check Hugging Face imports and exports; `make test-oldest`
# with .venv-oldest, the oldest releases zero_jax supports (constraints-oldest.txt).

# The newest Python 3.12+ that runs (JAX 0.11 and later need 3.12): the
# versioned names on the PATH, then pyenv's installed versions, whose PATH
# shims exit 127 unless pyenv is told the version, so every candidate is
# tested by running it, never only found. `make PYTHON=...` wins.
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null || echo $(HOME)/.pyenv)
PY_CANDIDATES = python3.15 python3.14 python3.13 python3.12 python3 \
	$(sort $(wildcard $(PYENV_ROOT)/versions/3.1[2-9]*/bin/python3 $(PYENV_ROOT)/versions/3.[2-9][0-9]*/bin/python3))
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell best=; top=0; for p in $(PY_CANDIDATES); do \
	  v=$$($$p -c 'import sys; v = sys.version_info; print(v[0] * 100 + v[1]) if v >= (3, 12) else exit(1)' \
	      2>/dev/null) || continue; \
	  [ "$$v" -gt "$$top" ] && best=$$p && top=$$v; done; echo $$best)
endif
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
IVENV  := .venv-interop
OVENV  := .venv-oldest
# transformers 5 with a torch release that has wheels for every Python 3.12+,
# and peft, which loads the LoRA adapters zero_jax exports.
INTEROP_PACKAGES := 'torch==2.13.0' 'transformers>=4.40' 'peft>=0.13'
# The tests compile hundreds of small programs, one compile per core at a
# time: one worker per core, each test file on one worker (its fixtures once).
TEST_WORKERS ?= 2
# What `test-oldest` runs on the oldest releases: the core, tests/core.txt,
# which scripts/gpu_checks.sh's `suite` part also runs on the GPU machines' JAX.
CORE_TESTS := $(shell cat tests/core.txt)

.PHONY: train test test-interop test-oldest venv clean FORCE

# The default job runs on 8 simulated CPU devices (the tests: tests/conftest.py).
train: $(STAMP)
	$(PY) scripts/train.py --devices 8

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/interop

test-interop: $(IVENV)/.installed
	$(IVENV)/bin/python -m pytest -q tests/interop

test-oldest: $(OVENV)/.installed
	$(OVENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(CORE_TESTS)

venv: $(STAMP)

# A venv is made anew unless its python runs and is the one $(PYTHON) names
# (same executable, same version): a venv left by another interpreter, an
# older Python say, does not survive a change of PYTHON.
%/.interpreter: FORCE
	@[ -n "$(PYTHON)" ] || { echo "zero_jax needs Python 3.12 or newer and none runs here (tried: $(PY_CANDIDATES)): install one, or name it: make PYTHON=/path/to/python3.12"; exit 1; }
	@want="$$($(PYTHON) -c 'import sys; print(sys.base_prefix, sys.version.split()[0]) if sys.version_info >= (3, 12) else exit(1)')" || \
	  { echo "zero_jax needs Python 3.12 or newer: $(PYTHON) is older or does not run (make PYTHON=python3.12, or newer)"; exit 1; }; \
	have="$$($*/bin/python -c 'import sys; print(sys.base_prefix, sys.version.split()[0])' 2>/dev/null)"; \
	if [ "$$have" != "$$want" ]; then \
	  echo "creating $* with $(PYTHON) (Python $${want##* })"; \
	  rm -rf $* && $(PYTHON) -m venv $* && echo "$$want" > $@; \
	elif [ "$$(cat $@ 2>/dev/null)" != "$$want" ]; then echo "$$want" > $@; fi

$(STAMP): pyproject.toml constraints.txt $(VENV)/.interpreter
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $@

$(IVENV)/.installed: pyproject.toml constraints.txt Makefile $(IVENV)/.interpreter
	$(IVENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	  -e '.[test]' $(INTEROP_PACKAGES)
	@touch $@

# The oldest releases, without the test extra's tools the core does not use.
$(OVENV)/.installed: pyproject.toml constraints-oldest.txt $(OVENV)/.interpreter
	$(OVENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-oldest.txt \
	  -e . pytest pytest-xdist
	@touch $@

FORCE:

clean:
	rm -rf $(VENV) $(IVENV) $(OVENV) build *.egg-info
