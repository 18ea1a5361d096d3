# The two commands a new user needs (see README.md):
#   make test        set up .venv and run the whole test suite (what CI runs)
#   make quickstart  set up .venv, run the quickstart notebook headless and a 300-step CLI run; outputs in runs/quickstart/
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= notebook,ray,megatron,tracking,lora,dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export MPLBACKEND := Agg

.PHONY: setup browser test quickstart clean

setup: $(VENV)/.installed

# torch first, pinned to the CPU build on this machine's disk; the project's own requirement is a range it meets.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# Debian's chromium for the real-browser notebook test (Playwright's own browser download does not work offline).
browser:
	@command -v chromium >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

test: setup browser
	$(PY) -m pytest -q -p no:cacheprovider

quickstart: setup
	mkdir -p runs/quickstart
	PATH="$(abspath $(VENV))/bin:$$PATH" ASYNCRL_FIGURES_DIR="$(CURDIR)/runs/quickstart" \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute notebooks/quickstart.ipynb \
		--ExecutePreprocessor.timeout=900 --output-dir runs/quickstart --output quickstart.ipynb
	@echo "executed notebook: runs/quickstart/quickstart.ipynb, its figures runs/quickstart/metrics.png and buffer.png"
	@echo "now 300 headless steps (README.md says how long they took, from benchmarks/data/bench_quickstart) -> runs/quickstart/cli/"
	$(VENV)/bin/asyncrl run quickstart --steps 300 --out runs/quickstart/cli

clean:
	rm -rf $(VENV) runs .pytest_cache
