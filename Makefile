# Both targets set up everything they need on a fresh Debian/Ubuntu machine:
# FUSE 3 (runtime + headers: pyfuse3 and colifs' native engine compile against them), a C compiler,
# Python's headers, fio (the drive model's test measures it), and a venv in .venv.
VENV ?= .venv
STAMP := $(VENV)/.installed
# Real GGUF files nobody here wrote: llama.cpp's vocabulary models, from the llama-cpp-python sdist.
LLAMA_CPP_PYTHON := 0.3.36
VOCAB := .cache/gguf-vocab
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

ENGINES_VENV := .venv-engines
XLLAMACPP := 2026.10.11549
# transformers' loader for contrib/bench/hf-load.sh; torch's CPU build (PyPI's pulls in CUDA).
TORCH := 2.13.0+cpu
TRANSFORMERS := 4.57.6
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test lint sysdeps clean bench-engines

demo: $(STAMP)
	$(VENV)/bin/python contrib/demo.py

test: $(STAMP) $(VOCAB)/.done
	$(VENV)/bin/ruff check colifs tests contrib setup.py
	$(VENV)/bin/ruff format --check colifs tests contrib setup.py
	COLIFS_GGUF_VOCAB_DIR=$(VOCAB) $(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check colifs tests contrib setup.py
	$(VENV)/bin/ruff format --check colifs tests contrib setup.py

# Optional: real inference engines for contrib/bench/llama-decode.sh (make test needs none of them).
bench-engines: $(STAMP) $(VOCAB)/.done
	[ -x $(ENGINES_VENV)/bin/python ] || python3 -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/pip install -q xllamacpp==$(XLLAMACPP)
	$(ENGINES_VENV)/bin/pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		torch==$(TORCH) transformers==$(TRANSFORMERS) safetensors
	@echo "ready: sudo COLIFS_GGUF_VOCAB_DIR=$(VOCAB) contrib/bench/llama-decode.sh; sudo contrib/bench/hf-load.sh"

PY_HEADERS := python3 -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"

sysdeps:
	@if ! command -v fusermount3 >/dev/null || ! pkg-config --exists fuse3 2>/dev/null \
			|| ! command -v gcc >/dev/null || ! command -v fio >/dev/null || ! $(PY_HEADERS); then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config \
			gcc python3-dev python3-venv fio; \
	fi
	@[ -e /dev/fuse ] || { echo "error: /dev/fuse is missing (modprobe fuse)"; exit 1; }

# The native engine is compiled by the install: a change to its sources installs again.
$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h) | sysdeps
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

$(VOCAB)/.done: | $(STAMP)
	rm -rf .cache/sdist $(VOCAB) && mkdir -p .cache/sdist $(VOCAB)
	$(VENV)/bin/pip download -q --no-deps --no-binary :all: -d .cache/sdist llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf .cache/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(VOCAB) --strip-components=4 \
		--wildcards 'llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/models/ggml-vocab-*.gguf'
	rm -rf .cache/sdist
	touch $@

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .cache *.egg-info .pytest_cache .ruff_cache .hypothesis
