# Two commands do all the set-up on a fresh machine:
#   make demo   - creates .venv, installs torch==2.13.0 (if missing) and the project, runs the demo
#   make test   - the same set-up with the test extras, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast bench sample-report clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, and only if the environment has none. On Linux x86-64 the PyPI wheel of
# torch==2.13.0 IS the CUDA build (it pulls the NVIDIA CUDA libraries, several GB); the pin only keeps
# the version fixed. For a CPU-only build, install it into .venv before running make (make keeps it):
#   python3 -m venv .venv && .venv/bin/python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# (or run make with TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH)
	touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[report,wandb,mlflow]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python examples/quickstart.py --log-dir sg_logs
	$(BIN)/stabilityguard report sg_logs -o sg_logs/report
	@echo "post-mortem: sg_logs/report/postmortem.md"

# Regenerates the sample post-mortem in reports/ from a fresh demo run.
sample-report: $(VENV)/.installed-demo
	rm -rf reports/demo-logs reports/quickstart
	$(BIN)/python examples/quickstart.py --log-dir reports/demo-logs --run-id quickstart-sample --quiet --trackers ""
	$(BIN)/stabilityguard report reports/demo-logs -o reports/quickstart

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -q

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -q -m "not slow"

bench: $(VENV)/.installed-demo
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) sg_logs .pytest_cache
