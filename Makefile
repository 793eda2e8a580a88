PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format install clean deps

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[model,dev,gpu]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/needlescope demo --out demo-out

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

# System packages tests need: Debian's prometheus (and promtool) for the canary tests.
deps:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

test: $(STAMP) deps lint
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n 2 tests

clean:
	rm -rf $(VENV) demo-out
