# The two set-up commands of the README:
#   make demo   installs what the demo needs and runs the 4-process sparse training demo
#   make test   installs everything (Horovod included) and runs the whole test suite
PYTHON ?= python3
NP ?= 4
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: demo test install install-horovod

install:
	PYTHON=$(PYTHON) bash tools/install.sh

install-horovod:
	PYTHON=$(PYTHON) bash tools/install.sh --horovod

demo: install
	$(PYTHON) -m tfsparse.run -np $(NP) $(PYTHON) keras_examples/digits_demo.py $(ARGS)

test: install-horovod
	$(PYTHON) -m pytest -ra $(PYTEST_ARGS)
