# Both targets set up everything they need on a fresh Debian/Ubuntu machine:
# FUSE 3 (runtime + headers, pyfuse3 compiles against them) and a venv in .venv.
VENV ?= .venv
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint sysdeps clean

demo: $(STAMP)
	$(VENV)/bin/python contrib/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check colifs tests contrib
	$(VENV)/bin/ruff format --check colifs tests contrib
	$(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check colifs tests contrib
	$(VENV)/bin/ruff format --check colifs tests contrib

sysdeps:
	@if ! command -v fusermount3 >/dev/null || ! pkg-config --exists fuse3 2>/dev/null; then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config; \
	fi
	@[ -e /dev/fuse ] || { echo "error: /dev/fuse is missing (modprobe fuse)"; exit 1; }

$(STAMP): pyproject.toml | sysdeps
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
