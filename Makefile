# Two commands: `make demo` and `make test`. Each sets up .venv on a fresh machine first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
# MXNet 1.9.1 needs NumPy < 2: its tests run in an environment of their own (docs/mxnet.md).
MXNET_VENV := .venv-mxnet
MXNET_PY := $(MXNET_VENV)/bin/python
MXNET_STAMP := $(MXNET_VENV)/.installed

.PHONY: demo test test-mxnet check install typecheck layers clean

$(STAMP): pyproject.toml requirements/frameworks.txt requirements/launchers.txt requirements/integrations.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/frameworks.txt -r requirements/launchers.txt -r requirements/integrations.txt
	$(PY) -m pip install --quiet -e '.[test]'
	# Keras 2 for the TF_USE_LEGACY_KERAS=1 tests; without --no-deps it pulls the full tensorflow wheel.
	$(PY) -m pip install --quiet --no-deps tf_keras==2.21.0
	touch $(STAMP)

install: $(STAMP)

# hora with MXNet 1.9.1 and NumPy < 2 (requirements/mxnet.txt), for tests/test_mxnet*.py.
$(MXNET_STAMP): pyproject.toml requirements/mxnet.txt
	$(PYTHON) -m venv $(MXNET_VENV)
	$(MXNET_PY) -m pip install --quiet --upgrade pip
	$(MXNET_PY) -m pip install --quiet -r requirements/mxnet.txt -e .
	touch $(MXNET_STAMP)

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
test: $(STAMP) $(MXNET_STAMP) typecheck layers
	bash scripts/setup-system.sh
	$(PY) -m pytest -q --durations=20
	$(MAKE) test-mxnet

# The MXNet binding's tests, in MXNet's environment (the main one does not collect them).
test-mxnet: $(MXNET_STAMP)
	$(MXNET_PY) -m pytest -q --durations=10 -W ignore::DeprecationWarning tests/test_mxnet.py tests/test_mxnet_training.py

# The fast layer alone (tests/conftest.py): one-process tests, no system setup, under a minute.
check: $(STAMP) layers
	$(PY) -m pytest -q -m unit

clean:
	rm -rf $(VENV) $(MXNET_VENV) .mypy_cache .pytest_cache
