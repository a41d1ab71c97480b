# The two set-up commands of the README:
#   make demo   installs what the demo needs and runs the 4-process sparse training demo
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

demo: install
	$(RUN_PYTHON) -m tfsparse.run -np $(NP) $(RUN_PYTHON) keras_examples/digits_demo.py --tensorboard results/tensorboard $(ARGS)

test: install-horovod
	$(RUN_PYTHON) -m pytest -ra $(PYTEST_ARGS)

test-fast: install
	$(RUN_PYTHON) -m pytest -ra -m fast $(PYTEST_ARGS)

# --strict: a broken link, a missing anchor or a docstring the API reference cannot render fails
docs: install
	NO_MKDOCS_2_WARNING=1 $(RUN_PYTHON) -m mkdocs build --strict
