# The README's commands. Each target sets up .venv itself (torch first, pinned, so that pip
# keeps the build it finds first instead of resolving `torch>=2.4` to another one).
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.10 || command -v python3)
TORCH  ?= torch==2.13.0
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# What a float owes to this CPU shows up on another one. The suite and the notebooks run once
# as each of these machines would run them: OpenBLAS's kernel (numpy, scipy), MKL's code path
# and torch's vector kernels (torch), and torch's thread count.
PORTABLE := "OPENBLAS_CORETYPE=Haswell MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1" \
            "OPENBLAS_CORETYPE=Sandybridge MKL_CBWR=AVX ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=2"

.PHONY: setup chromium demo test test-py test-notebooks test-browser test-portable lab bench \
        docs lint widgets clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "somatize needs Python 3.10 or later; '$(PYTHON)' is not: run make $(MAKECMDGOALS) PYTHON=python3.11" >&2; \
	  exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	  echo "'$(PYTHON)' cannot make a virtual environment: run apt-get install -y python3-venv (or pass PYTHON=)" >&2; \
	  exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev,docs]"
	touch $(STAMP)

# The browser tests drive Debian's chromium (never a browser that playwright downloads), and
# draw names in Chinese, which needs a CJK font. As root with apt what is missing is installed
# here; otherwise one line says what to run.
chromium:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing=" chromium"; \
	fc-list :lang=zh 2>/dev/null | grep -q . || missing="$$missing fonts-wqy-zenhei"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing for the browser tests: apt-get install$$missing"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } || { \
	      echo "apt-get could not install$$missing: install it yourself, then make $(MAKECMDGOALS) again" >&2; exit 1; }; \
	  else \
	    echo "the browser tests need$$missing: run 'sudo apt-get install -y$$missing', then make $(MAKECMDGOALS) again" >&2; \
	    exit 1; \
	  fi; \
	fi

demo: setup
	$(BIN)/python -m somatize.demo --out demo.html

test: chromium setup
	$(BIN)/ruff check somatize tests bench
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory test-notebooks

test-py: setup
	$(BIN)/python -m pytest -q tests --ignore=tests/browser

test-notebooks: setup
	$(BIN)/python -m pytest -q --nbval notebooks --nbval-sanitize-with notebooks/sanitize.cfg

test-browser: chromium setup
	$(BIN)/python -m pytest -q tests/browser

test-portable: chromium setup
	@failed=""; for said in $(PORTABLE); do \
	  echo "== $$said"; \
	  env $$said $(BIN)/python -m pytest tests || failed="$$failed\n  tests under $$said"; \
	  env $$said $(MAKE) --no-print-directory test-notebooks || failed="$$failed\n  notebooks under $$said"; \
	done; \
	if [ -n "$$failed" ]; then printf "test-portable failed:$$failed\n" >&2; exit 1; fi

docs: setup
	$(BIN)/python docs/build.py

widgets:
	sh widgets/build.sh

lab: setup
	$(BIN)/jupyter lab notebooks

bench: setup
	@$(BIN)/python -c 'import torchview' 2>/dev/null || $(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/all.py

lint: setup
	$(BIN)/ruff check somatize tests bench

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache test-artifacts demo.html site
