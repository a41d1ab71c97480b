# The two set-up commands of the README:
#   make demo   installs what the demo needs and runs the 4-process demo: dense against auto, accuracy against seconds
#   make test   installs everything (Horovod included) and runs the whole test suite
# and, for development (not CI):
#   make test-fast  installs what make demo does and runs the `fast` subset (tests/conftest.py: the tests
#                   not marked mpi, the slow ones left out, and one small MPI job per area), ~5 min on 2 cores
# and one for the documentation site (mkdocs.yml, pages in docs/):
#   make docs   installs what make demo does (the doc tools included) and builds the site strictly into build/site
# PYTHON (default python3) is the interpreter to use; an externally managed one (PEP 668, such as
# Debian's python3) gets the project virtualenv .venv instead, and everything runs with that.
PYTHON ?= python3
NP ?= 4
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

# the interpreter tools/install.sh installs into: $(PYTHON) itself, or .venv/bin/python
RUN_PYTHON := $(shell PYTHON='$(PYTHON)' bash tools/install.sh --print-python)
ifeq ($(RUN_PYTHON),)
$(error PYTHON=$(PYTHON) is not an interpreter on this machine; accepted: a python3 command or path)
endif
ifneq ($(RUN_PYTHON),$(PYTHON))
export PATH := $(dir $(RUN_PYTHON)):$(PATH)
endif

.PHONY: demo test test-fast docs install install-horovod

install:
	PYTHON='$(PYTHON)' bash tools/install.sh

install-horovod:
	PYTHON='$(PYTHON)' bash tools/install.sh --horovod

# the demo: dense float32 against auto, to dense's own accuracy, on an emulated 1 Gbit/s link
# when this machine can make one (root, ip, tc: tfsparse-run --net), else on shared memory
CAN_EMULATE = from tfsparse.network import check_can_emulate; check_can_emulate()
DEMO = keras_examples/time_to_accuracy.py --demo

demo: install
	@if $(RUN_PYTHON) -c "$(CAN_EMULATE)" 2>/dev/null; then \
	  echo "make demo: $(NP) ranks, each behind an emulated 1 Gbit/s link (tfsparse-run --net 1gbit)"; \
	  $(RUN_PYTHON) -m tfsparse.run -np $(NP) --net 1gbit $(RUN_PYTHON) $(DEMO) --network "1 Gbit/s (tfsparse-run --net 1gbit)" $(ARGS); \
	else \
	  echo "make demo: no emulated network on this machine (it needs root, ip and tc): shared memory, where communication costs little"; \
	  $(RUN_PYTHON) -m tfsparse.run -np $(NP) $(RUN_PYTHON) $(DEMO) --network "shared memory" $(ARGS); \
	fi

test: install-horovod
	$(RUN_PYTHON) -m pytest -ra $(PYTEST_ARGS)

test-fast: install
	$(RUN_PYTHON) -m pytest -ra -m fast $(PYTEST_ARGS)

# --strict: a broken link, a missing anchor or a docstring the API reference cannot render fails
docs: install
	NO_MKDOCS_2_WARNING=1 $(RUN_PYTHON) -m mkdocs build --strict
