# The README's commands. Each target sets up .venv itself (torch first, as a CPU build).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-py test-notebooks test-browser lab bench docs lint widgets clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,docs]"
	touch $(STAMP)

demo: setup
	$(BIN)/python -m somatize.demo --out demo.html

test: setup
	$(BIN)/ruff check somatize tests bench
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory test-notebooks

test-notebooks: setup
	$(BIN)/python -m pytest -q --nbval notebooks --nbval-sanitize-with notebooks/sanitize.cfg

docs: setup
	$(BIN)/python docs/build.py

test-browser: setup
	$(BIN)/python -m pytest -q tests/browser

widgets:
	sh widgets/build.sh

lab: setup
	$(BIN)/jupyter lab notebooks

bench: setup
	$(BIN)/python bench/all.py

lint: setup
	$(BIN)/ruff check somatize tests bench

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache test-artifacts demo.html
