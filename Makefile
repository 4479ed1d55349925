# sbpstream: the two commands are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA   ?= data
PYTEST_ARGS ?=

.PHONY: run test install sysdeps lint typecheck unit tier suite bench clean dist

$(STAMP): pyproject.toml setup.py $(wildcard sbpstream/*/*.pyx)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "sbpstream needs Python >= 3.11"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  echo "python venv missing: installing python3-venv"; apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark,etcd]'
	@# an editable install hides pyspark_sbpstream from Spark's data source scan: a .pth shows it
	$(BIN)/python -c 'from sbpstream.spark import install_plugin_path; install_plugin_path()'
	@touch $(STAMP)

install: $(STAMP)
	@# byte-compile the package (up-to-date files are skipped): the generated message code is
	@# 280 KB of source, 0.2 s to compile in every process that imports it without a .pyc
	@# (an environment with PYTHONDONTWRITEBYTECODE set never writes one itself)
	@$(BIN)/python -m compileall -q sbpstream pyspark_sbpstream.py > /dev/null
	@# the JVM batch reader format("sbpstream-jvm"): a JDK (apt-get when javac is missing), then
	@# its jar in sbpstream/spark/build/ (rebuilt only when the Java sources changed)
	@bash scripts/ensure-sysdeps.sh jdk
	@$(BIN)/python -m sbpstream.spark.jvm --if-stale > /dev/null

sysdeps:
	@bash scripts/ensure-sysdeps.sh

run: install
	@mkdir -p $(DATA)
	@echo "(in a second terminal, first: source $(VENV)/bin/activate  -- puts 'sbpstream' on PATH)"
	$(BIN)/sbpstream up --dir $(DATA)

lint: install
	$(BIN)/ruff check sbpstream tests bench pyspark_sbpstream.py

typecheck: install
	$(BIN)/mypy sbpstream pyspark_sbpstream.py

# the unit tier only: in-process tests, no sockets, processes or files (tests/conftest.py sorts
# every test into one tier from what it uses)
unit: install
	$(BIN)/python -m pytest -q -m unit $(PYTEST_ARGS)

# one tier of the suite: make tier TIER=unit, integration, adversity or spark
TIER ?= unit
tier: install
	$(BIN)/python -m pytest -q -m $(TIER) $(PYTEST_ARGS)

# the whole pytest suite, every tier
suite: install sysdeps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test: install sysdeps lint typecheck suite

bench: install sysdeps
	$(BIN)/python -m bench.run_all

# wheel and sdist in dist/ (pip install 'dist/sbpstream-<version>-py3-none-any.whl[spark]')
dist: install
	rm -rf dist build/lib
	$(BIN)/python -m build --outdir dist .
	@ls -1 dist

clean:
	rm -rf $(VENV) $(DATA) dist build .mypy_cache .ruff_cache .pytest_cache .hypothesis
