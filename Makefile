# Cascade: one command to set up and run the main job, one to set up and pass the tests.
#   make demo   - install, then run the tiny four-stage cascade on CPU
#   make test   - install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch where one lies on disk (pip finds it); set TORCH_SPEC for another build.
TORCH_SPEC ?= torch==2.13.0
OUT ?= runs/demo

.PHONY: setup system-deps demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on "$(TORCH_SPEC)"
	$(BIN)/pip install --progress-bar on -e ".[dev]"
	touch $@

# bubblewrap isolates the code sandbox; g++ builds the native CPU generation ops and judges C++ solutions
# (Debian/Ubuntu; needs root or sudo, and only what is missing is installed).
system-deps:
	@PKGS=""; command -v bwrap >/dev/null 2>&1 || PKGS="$$PKGS bubblewrap"; \
	command -v g++ >/dev/null 2>&1 || PKGS="$$PKGS g++"; \
	[ -z "$$PKGS" ] || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$PKGS; }

demo: setup system-deps
	$(BIN)/cascade run profile=tiny out=$(OUT)

# two workers (pytest-xdist), each test file on one; `$(BIN)/pytest -q` runs the same tests in one process
test: setup system-deps
	$(BIN)/pytest -q -n 2 --dist loadfile

bench: setup system-deps
	for b in benchmarks/*.py; do $(BIN)/python $$b; done

clean:
	rm -rf $(VENV) runs .pytest_cache
