# Fresh clone -> `make run` or `make test`; nothing to do by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint calc clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[quant,dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) main.py

test: setup
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

lint: setup
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build dist *.egg-info assets/embedded/build
