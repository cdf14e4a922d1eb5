# Two commands do everything on a fresh machine (see README):
#   make demo   - set up, then run the job on the fixtures into ./lakehouse and print the summary
#   make test   - set up, then run the whole test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rulewatch-installed

.PHONY: setup demo test clean browser

setup: $(STAMP)

# Pinned set (requirements.lock) + the Delta and Spark-Kafka jars and the Apache Kafka broker's jars,
# fetched once from Maven Central (python -m rulewatch.jars); afterwards every run and test works offline.
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev,local]'
	$(BIN)/python -m rulewatch.jars
	touch $(STAMP)

demo: setup
	$(BIN)/rulewatch run --lakehouse lakehouse --transactions fixtures/transactions --rules fixtures/rules.json

test: setup browser
	$(BIN)/pytest -q

# The report's browser test (tests/test_report_browser.py) looks at it in headless Chromium, and fails
# rather than skips without one: install Debian's package when it is missing (as root, or through sudo).
browser:
	@test -x /usr/bin/chromium || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi; }

clean:
	rm -rf lakehouse .pytest_cache
