"""``python -m rulewatch.cli.setup`` (``make setup``): fetch, once, the jars every later run and test uses offline.

Spark's Delta Lake and Kafka-connector jars and the local Kafka broker's, from Maven Central into
``$RULEWATCH_HOME`` (default ``~/.cache/rulewatch``); a second call finds them and fetches nothing.
"""

from __future__ import annotations

import fcntl
import sys
from pathlib import Path

from rulewatch.kafka.broker import fetch_broker_jars
from rulewatch.spark.runtime.env import cache_home
from rulewatch.spark.runtime.jars import fetch_spark_jars


def _said(what: str, jars: list[Path]) -> str:
    folders = sorted({str(jar.parent) for jar in jars})
    return f"rulewatch setup: {what}: {len(jars)} jars in {', '.join(folders)}"


def main() -> int:
    print("rulewatch setup: fetching jars from Maven Central where they are not cached yet ...", file=sys.stderr)
    cache_home().mkdir(parents=True, exist_ok=True)
    # `make test` sets up both venvs at once, and both want the broker's jars: one fetch at a time, so
    # that neither copies a jar over one the other has already started a JVM with.
    with open(cache_home() / "setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(_said("Delta Lake and Spark's Kafka connector", fetch_spark_jars()))
        print(_said("the local Kafka broker", fetch_broker_jars()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
