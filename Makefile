# Two commands do everything on a fresh machine (see README):
#   make demo   - set up, then run the job on the fixtures into ./lakehouse and print the summary
#   make test   - set up, then run the whole test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rulewatch-installed

.PHONY: setup demo test clean

setup: $(STAMP)

# Pinned set (requirements.lock) + the Delta and Spark-Kafka jars and the Apache Kafka broker's jars,
# fetched once from Maven Central (python -m rulewatch.jars); afterwards every run and test works offline.
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev,local,remote]'
	$(BIN)/python -m rulewatch.jars
	touch $(STAMP)

demo: setup
	$(BIN)/rulewatch run --lakehouse lakehouse --landing fixtures/transactions --rules fixtures/rules.json

test: setup
	$(BIN)/pytest -q

clean:
	rm -rf lakehouse .pytest_cache
