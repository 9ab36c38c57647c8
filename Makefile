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

# The llama.cpp extra builds llama.cpp from source (minutes, once: pip caches the wheel); only the tests need it.
# The mlx extra (MLX's CPU wheel on Linux, and mlx-lm) rides along: the MLX runtime's tests need it.
LLAMACPP_STAMP := $(VENV)/.llamacpp-installed

$(LLAMACPP_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[quant,dev,llamacpp,mlx]'
	touch $(LLAMACPP_STAMP)

test: setup $(LLAMACPP_STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

lint: setup
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build dist *.egg-info assets/embedded/build

# The desktop app: a one-folder PyInstaller bundle in dist/kvscope/, checked by its own --self-test.
.PHONY: package icons
PACKAGE_STAMP := $(VENV)/.package-installed

$(PACKAGE_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[quant,dev,package]'
	touch $(PACKAGE_STAMP)

icons: setup
	QT_QPA_PLATFORM=offscreen $(PY) scripts/make_icons.py

package: $(PACKAGE_STAMP)
	$(VENV)/bin/pyinstaller packaging/kvscope.spec --noconfirm --distpath dist --workpath build
	QT_QPA_PLATFORM=offscreen dist/kvscope/kvscope --self-test
	du -sh dist/kvscope
