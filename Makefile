# Two commands do everything on a fresh machine (see README):
#   make demo   - set up, then run the job on the fixtures into ./lakehouse and print the summary
#   make test   - set up, then run the whole test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rulewatch-installed

.PHONY: setup setup-spark40 demo test test-fast test-spark40 clean browser

setup: $(STAMP)

# Pinned set (requirements.lock) + the Delta and Spark-Kafka jars and the Apache Kafka broker's jars,
# fetched once from Maven Central (python -m rulewatch.cli.setup); afterwards every run and test works offline.
# Then the JVM's class archive, which makes every later Spark start faster (rulewatch.spark.runtime.class_archive).
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev,local,remote]'
	$(BIN)/python -m rulewatch.cli.setup
	$(BIN)/python -m rulewatch.spark.runtime.class_archive
	touch $(STAMP)

demo: setup
	$(BIN)/rulewatch run --lakehouse lakehouse --landing fixtures/transactions --rules fixtures/rules.json
	@echo
	@echo "Next:"
	@echo "  $(BIN)/rulewatch report --lakehouse lakehouse      # an HTML report of these alerts (report.html)"
	@echo "  $(BIN)/rulewatch demo --lakehouse lakehouse-live   # live mode: generated traffic, alerts as they fire"
	@echo "  notebooks/00_setup.ipynb ... 03_gold.ipynb         # the same steps one layer at a time (04: explore a rule)"
	@echo "  README.md: rules, Kafka, deploying the bundle (databricks bundle deploy)"

# The three set-ups side by side (each mostly one core: pip, the class archive's JVM, apt): ~130 s against
# ~196 s one after the other on a fresh clone with warm caches (docs/testing.md).
test:
	$(MAKE) --no-print-directory -j3 setup setup-spark40 browser
	$(BIN)/pytest -q
	$(MAKE) --no-print-directory test-spark40

# The inner loop: every test that needs no JVM, kernel, process of its own, broker or browser (engine, rules,
# bundle, views' SQL text, CLI parsing, remote), in well under a minute. Pure Python, so two workers use both
# cores (unlike the whole suite, whose JVMs already do: docs/testing.md). The markers are in pyproject.toml;
# a test that starts a JVM here fails with a message saying to mark it jvm (tests/conftest.py).
FAST := not jvm and not notebook and not subprocess and not kafka and not browser and not slow
test-fast: setup
	$(BIN)/pytest -q -n 2 -m "$(FAST)"

# The oldest Spark line the supported Databricks Runtimes run (17.3 LTS is Spark 4.0.0; docs/deploy.md):
# the Spark-facing tests run there too (SPARK40_TESTS), in a second venv with the same lock but
# pyspark 4.0.0. 4.0.0 exactly: the runtime's own line, and the newest 4.0 whose Kafka connector
# jars Maven serves here; delta-spark's Python package (4.4.0, as in the lock) asks for 4.0.1 but its
# delta-spark_4.0 jars are built for the 4.0 line, hence --no-deps.
VENV40 := .venv-spark40
STAMP40 := $(VENV40)/.rulewatch-installed
# The layers through Spark (silver's checks, gold's alerts against the fixtures' expected ones, the
# packing of rows for the evaluator), which state path the Python workers take and the session's file
# settings (a class they name moved after 4.0); the engine's own tests are plain Python and need no second run.
# The state path on classic Spark only: pyspark 4.0's Spark Connect client has no
# transformWithStateInPandas (it came to Connect in 4.1), so Connect runs on the main leg alone.
# Gold straight from a Kafka topic (two chained stateful operators, the live default there) against gold from silver.
# A new table's first commit as that release's Delta writes it (made aside in a session of its own).
# Gold's routing tables read by a Python data source, whose API came in 4.0.
SPARK40_TESTS := tests/test_fixtures_oracle.py tests/test_pipeline.py tests/test_silver.py tests/test_bad_input.py tests/test_session.py \
	tests/test_packing.py tests/test_state_batch.py::test_spark_python_workers_take_the_pipelined_path[classic] tests/test_gold_from_source.py \
	tests/test_first_commit.py tests/test_log_source.py

setup-spark40: $(STAMP40)

$(STAMP40): pyproject.toml requirements.lock Makefile  # this recipe's own packages too (confluent-kafka came later)
	$(PYTHON) -m venv $(VENV40)
	$(VENV40)/bin/python -m pip install --quiet --upgrade pip
	grep -v -e '^pyspark' -e '^delta' requirements.lock > $(VENV40)/constraints.txt
	$(VENV40)/bin/python -m pip install --quiet -c $(VENV40)/constraints.txt -e '.[dev,remote]' 'pyspark[connect]==4.0.0' 'protobuf>=6.33' confluent-kafka
	$(VENV40)/bin/python -m pip install --quiet --no-deps delta-spark==4.4.0
	$(VENV40)/bin/python -m rulewatch.cli.setup
	touch $(STAMP40)

# On Spark's own Python worker daemon: the main leg starts workers from rulewatch.spark.runtime.worker_daemon,
# so the fallback (RULEWATCH_WORKER_DAEMON=off, and every session not built here) is checked here.
test-spark40: setup-spark40
	RULEWATCH_WORKER_DAEMON=off $(VENV40)/bin/pytest -q $(SPARK40_TESTS)

# The report's browser test (tests/test_report_browser.py) looks at it in headless Chromium, and fails
# rather than skips without one: install Debian's package when it is missing (as root, or through sudo).
browser:
	@test -x /usr/bin/chromium || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi; }

clean:
	rm -rf lakehouse lakehouse-live report.html .pytest_cache
