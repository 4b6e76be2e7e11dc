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

.PHONY: run test install install-dev bench clean

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

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q --durations=15

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) storage mlflow.db
