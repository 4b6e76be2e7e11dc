# Two commands to know: `make run` (the main job on the default recipe) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; on a GPU machine use `make run TORCH=` to take pip's default build.
TORCH  ?= torch==2.13.0
RECIPE ?= default
SOURCE ?=
STORAGE ?=
SET    ?=

.PHONY: run test test-fast lint install install-dev bench clean docker-setup image

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first and alone: asked for together with the project, pip takes PyPI's CUDA build of
# the same version over the CPU wheel that pip's find-links offers on the machines we test on.
$(VENV)/.torch: | $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	touch $@

# constraints.txt holds versions known to resolve together: without it pip takes the newest
# boto3 for moto, then backtracks through hundreds of releases to meet s3fs's exact pin.
$(VENV)/.installed: pyproject.toml constraints.txt $(VENV)/.torch
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[pipeline]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt $(VENV)/.torch
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/mllm-pipeline run --recipe $(RECIPE) $(if $(SOURCE),--source "$(SOURCE)") \
		$(if $(STORAGE),--storage "$(STORAGE)") $(foreach s,$(SET),--set "$(s)")

# Three workers (pytest-xdist) on 2 cores, a test file each at a time: a module's tests share its
# servers and fixtures and run in order on one worker (--dist loadfile); the five modules that each
# run a whole stack are one lane, one after another (tests/conftest.py, ONE_LANE). The third fills the time
# the others wait on servers, outages and back-offs (two kept 2 Zen 5 cores 69% busy, three 86%:
# 16 min 31 s to 13 min 0 s; on a CPU the suite keeps busy already it changes nothing,
# docs/benchmarks/test-suite.md). The whole suite is the gate (CI runs it); test-fast, the inner loop
# (its goal: 90 s on 2 cores; 66-75 s on a Zen 3 EPYC), leaves out the tests marked integration (real flows, CLI
# commands, servers; only those get a Prefect server)
# and slow (compiles, DDP ranks, trainings to a figure: seconds to a minute each).
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q --durations=15 -n 3 --dist loadfile

# ruff's format check and lint (configured in pyproject.toml); `ruff format` and `ruff check --fix` mend most.
LINTED := mllm tasks flows tests benchmarks
lint: $(VENV)/.installed-dev
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q --durations=10 -n 2 --dist loadfile -m "not integration and not slow"

# A Docker engine and a registry on 127.0.0.1:5001 (as root: installs docker.io, docker-registry
# and debootstrap from Debian's packages when missing). `make test` then runs tests/infra/test_docker.py.
docker-setup:
	infra/docker/setup.sh

# The training image at this commit, from the local debootstrap base and the CPU torch wheel of
# pip's find-links folder (set TORCH_WHEEL= for PyPI's CUDA build, BASE_IMAGE for another base).
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))
REGISTRY ?=
image:
	infra/docker/build-image.sh $(if $(BASE_IMAGE),,--local-base) $(if $(TORCH_WHEEL),--torch-wheel "$(TORCH_WHEEL)") \
		$(if $(REGISTRY),--push "$(REGISTRY)")

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.run

# What `make run` (and the CLI run here with its defaults) leaves in this folder, and nothing else:
# the venv and the editable install's metadata, ./storage, MLflow's store (mlflow.db, the lock
# its creation takes, SQLite's journals) and its artifact store (mlruns/: the registered models'
# files), and a search's study beside them (optuna.db, optuna.locks/). README's "Outputs" lists them.
clean:
	rm -rf $(VENV) mllm_pipeline.egg-info storage mlflow.db mlflow.db.lock mlflow.db-journal mlflow.db-wal \
		mlflow.db-shm mlruns optuna.db optuna.locks
