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

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[pipeline]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/mllm-pipeline run --recipe $(RECIPE) $(if $(SOURCE),--source "$(SOURCE)") \
		$(if $(STORAGE),--storage "$(STORAGE)") $(foreach s,$(SET),--set "$(s)")

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) storage mlflow.db
