# Two commands: `make demo` and `make test`. Each sets up .venv on a fresh machine first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo test check install typecheck layers clean

$(STAMP): pyproject.toml requirements/frameworks.txt requirements/launchers.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/frameworks.txt -r requirements/launchers.txt
	$(PY) -m pip install --quiet -e '.[test]'
	# Keras 2 for the TF_USE_LEGACY_KERAS=1 tests; without --no-deps it pulls the full tensorflow wheel.
	$(PY) -m pip install --quiet --no-deps tf_keras==2.21.0
	touch $(STAMP)

install: $(STAMP)

# What the demo needs and nothing more: hora, torch (CPU build), scikit-learn. With pip's
# progress bars: the first run downloads ~300 MB (torch's CPU wheel is 190 MB) into a 1.2 GB .venv.
$(DEMO_STAMP): pyproject.toml requirements/demo.txt
	@echo "make demo, first run: installing hora, torch (CPU build) and scikit-learn into $(VENV): ~300 MB to download, then the job trains for about a minute"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -r requirements/demo.txt -e '.[demo]'
	touch $@

# A data-parallel PyTorch training job on scikit-learn's digits, 2 ranks, through horarun.
demo: $(DEMO_STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/horarun -np 2 $(PY) examples/pytorch/train_digits.py

typecheck: $(STAMP)
	$(PY) -m mypy

# The import contracts of pyproject.toml: layers, bindings through the core, no cycles.
layers: $(STAMP)
	$(VENV)/bin/lint-imports

# The whole suite: static types, the import contracts, then every test (multi-process tests start their own ranks).
# scripts/setup-system.sh installs the system pieces the launcher tests use for real (sshd,
# network namespaces, Open MPI, MPICH, Slurm); it is quick when they are already there.
test: $(STAMP) typecheck layers
	bash scripts/setup-system.sh
	$(PY) -m pytest -q --durations=20

# The fast layer alone (tests/conftest.py): one-process tests, no system setup, under a minute.
check: $(STAMP) layers
	$(PY) -m pytest -q -m unit

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache
