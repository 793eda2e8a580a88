PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: example test lint format install clean deps mutation

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[model,dev,gpu]'
	touch $(STAMP)

install: $(STAMP)

# The investigation of the organism's deployment-like setting (fp8 keys, top-64, page-table
# fault): the example ledger, run from scratch; ends with example-out/DIAGNOSIS.md and .html.
# (`needlescope demo` is another pipeline: it serves, probes and explains; docs/organism.md.)
example: $(STAMP)
	rm -rf example-out
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/needlescope investigate init example-out
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/needlescope investigate run example-out/investigation.toml --out example-out

# Mutation testing of the statistics and verdict code (minutes of CPU; not part of `make test`):
# mutmut per module with only the tests that cover it; the score and every surviving mutant's
# diff land in mutation-out/ (docs/mutation.md lists the equivalent ones).
mutation: $(STAMP)
	$(BIN)/python bench/mutation.py --out mutation-out

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

# System packages the tests need, skipped when present: headless Chromium screenshots
# DIAGNOSIS.html; Debian's prometheus (and its promtool) scrapes the canary in the watch tests.
DEB_PACKAGES := chromium prometheus
deps:
	@command -v chromium >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_PACKAGES); }

test: $(STAMP) deps lint
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n 2 tests

clean:
	rm -rf $(VENV) example-out mutation-out
