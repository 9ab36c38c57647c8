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

# The bundle ships llama.cpp (the llamacpp extra, CPU build) so the packaged app runs GGUF models.
$(PACKAGE_STAMP): $(STAMP) $(LLAMACPP_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[quant,dev,llamacpp,package]'
	touch $(PACKAGE_STAMP)

icons: setup
	QT_QPA_PLATFORM=offscreen $(PY) scripts/make_icons.py

package: $(PACKAGE_STAMP)
	$(VENV)/bin/pyinstaller packaging/kvscope.spec --noconfirm --distpath dist --workpath build
	QT_QPA_PLATFORM=offscreen dist/kvscope/kvscope --self-test
	du -sh dist/kvscope

# A Debian package of the bundle: dist/kvscope_<version>_<arch>.deb (/opt/kvscope, /usr/bin/kvscope, the desktop
# entry and icons); builds the bundle first if there is none. Needs dpkg-deb (Debian, Ubuntu).
.PHONY: deb
deb: setup
	test -x dist/kvscope/kvscope || $(MAKE) package
	$(PY) scripts/make_deb.py --bundle dist/kvscope --out dist
