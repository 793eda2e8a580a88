PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NEEDLESCOPE := PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/needlescope
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

# torch's CPU build, pinned by its exact local version: PyPI's torch 2.13.0 for Linux x86_64 is
# the CUDA build (a 527 MB wheel that pulls the nvidia-* runtime wheels), and `==2.13.0+cpu`
# matches only the CPU wheel (192 MB). pip takes it from its configured sources when they hold
# it; where none does, PyPI's torch==2.13.0 (which runs on a CPU too) is the fallback, since
# nothing here may reach an index other than PyPI. constraints.txt's torch==2.13.0 admits either.
TORCH := torch==2.13.0+cpu

# --no-compile: no bytecode for every module of every package up front (270 MB of __pycache__
# with torch, transformers and sympy); Python writes it for the modules a command imports.
PIP := $(BIN)/pip install -q --no-compile -c constraints.txt

.PHONY: demo test lint format install clean deps mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)

# What the demo needs and nothing more: the [model] extra on CPU torch.
$(DEMO_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) '$(TORCH)' 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e '.[model]'
	touch $@

# The tests' extras on top: dev (pytest, the openai client, lm-eval, schemathesis, ...) and gpu
# (triton: the kernel tests run under its interpreter on a CPU).
$(STAMP): $(DEMO_STAMP)
	$(PIP) -e '.[model,dev,gpu]'
	$(PIP) --no-deps $(SGLANG_TEST)
	touch $@

# The [sglang] test extra: SGLang's own dumper, comparator and io_struct (tests/test_sglang_own.py),
# pinned in constraints.txt. --no-deps: sglang's own requirements pull a CUDA torch and GBs of
# serving stack; these are exactly what `import sglang.srt.debug_utils.dumper`, its comparators and
# io_struct need on our torch (about 330 MB installed; docs/peers.md). No torchvision: PyPI's is a
# CUDA build that cannot load on the CPU torch (tests/sglang_own.py stands in for it). No uvloop
# (SGLang's tokenizer manager wants it): uvicorn would run our own server on it once installed.
SGLANG_TEST := sglang orjson pyzmq pybase64 msgspec ipython traitlets apache-tvm-ffi sentencepiece \
	compressed-tensors loguru gguf partial-json-parser polars polars-runtime-32 einops

install: $(STAMP)

# The investigation of the organism's deployment-like setting (fp8 keys, top-64, page-table
# fault): ends with demo-out/DIAGNOSIS.md and .html. Nothing is deleted, ever. The example
# ledger is written only when demo-out/investigation.toml is missing, so your edits to it stay.
# A rerun resumes the run in demo-out (finished steps are kept; the reports are rewritten); a
# run of an edited ledger is refused there in one line: run it into a new folder
# (needlescope investigate run demo-out/investigation.toml --out demo-out/edited). Files of
# yours in demo-out are never touched; one at a name the run writes (DIAGNOSIS.md, ...) is
# refused by name (needlescope.outdir).
demo: $(DEMO_STAMP)
	test -f demo-out/investigation.toml || $(NEEDLESCOPE) investigate init demo-out
	$(NEEDLESCOPE) investigate run demo-out/investigation.toml --out demo-out

# Mutation testing of the statistics and verdict code (minutes of CPU; not part of `make test`):
# mutmut per module with only the tests that cover it; the score and every surviving mutant's
# diff land in mutation-out/ (docs/mutation.md lists the equivalent ones).
mutation: $(STAMP)
	$(BIN)/python bench/mutation.py --out mutation-out

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# System packages the tests need, skipped when present: headless Chromium screenshots
# DIAGNOSIS.html; Debian's prometheus (and its promtool) scrapes the canary in the watch tests.
DEB_PACKAGES := chromium prometheus
deps:
	@command -v chromium >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_PACKAGES); }

# Two workers, each taking whole test files, longest first (tests/schedule.py): a file's module
# fixtures (servers, reference runs) are built once, and the two workers end together.
test: $(STAMP) deps lint
	PYTHONPATH=$(CURDIR)/src HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# Deletes the virtual environment and mutation-out/ (both ours); demo-out/ holds your ledger and
# is left for you to delete.
clean:
	rm -rf $(VENV) mutation-out
