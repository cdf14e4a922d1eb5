"""Is the Kafka source there? A dead cluster must be an error, never a quiet stream of zero rows.

Spark's Kafka source does not tell "no traffic" from "no broker": against a dead bootstrap a batch run
waits forever and a live stream reports 0 rows/s. So the commands ask the cluster themselves, with
a bounded wait (``RULEWATCH_KAFKA_TIMEOUT``, default 30 s):

- before a lakehouse is bound to a topic: the cluster must answer and hold the topic (a mistyped
  topic on the first run would otherwise bind the lakehouse to it);
- during a batch run (``Watch`` beside the query): unanswered for the timeout, the run stops with
  the cluster's address; its checkpoint is intact, so the next run continues;
- during a live stream: the first unanswered probe is a warning, recovery is reported with the
  outage's length, and the command's exit code says there was one.

The probe is a metadata request (confluent-kafka, the ``local`` extra); where that client is not
installed (a Databricks cluster) it falls back to opening a TCP connection to each bootstrap server.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rulewatch.engine.rules import parse_duration
from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, client_config

TIMEOUT_ENV = "RULEWATCH_KAFKA_TIMEOUT"
DEFAULT_TIMEOUT = "30s"
PROBE_EVERY_S = 5.0


class KafkaUnreachable(KafkaConfigError):
    """The Kafka cluster did not answer in time: names it, how long was waited, and what to check."""


def timeout_s() -> float:
    """How long a command waits for the cluster before calling it unreachable (``RULEWATCH_KAFKA_TIMEOUT``)."""
    text = os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    try:
        return parse_duration(text) / 1000
    except ValueError as err:
        raise KafkaConfigError(f"{TIMEOUT_ENV}={text!r}: {err}") from None


def _unreachable(topic: KafkaTopic, waited: float, detail: str) -> str:
    return (
        f"Kafka at {topic.bootstrap} did not answer within {waited:g}s ({detail}): is the broker running and "
        f"reachable from here? Check --kafka-bootstrap; {TIMEOUT_ENV} sets how long to wait"
    )


def probe(topic: KafkaTopic, timeout: float) -> tuple[str | None, frozenset[str] | None]:
    """(None, the cluster's topics) if it answered within ``timeout``; else (why, None).

    Without the Python client the topics are unknown (None): only a TCP connection is tried."""
    try:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient
    except ModuleNotFoundError:
        return _connect(topic, timeout), None
    try:
        metadata = AdminClient(client_config(topic) | {"log_level": 0}).list_topics(timeout=timeout)
    except KafkaException as err:
        return err.args[0].str() if err.args else str(err), None
    return None, frozenset(metadata.topics)


def _connect(topic: KafkaTopic, timeout: float) -> str | None:
    errors = []
    for server in topic.bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return None
        except OSError as err:
            errors.append(f"{server.strip()}: {err.strerror or err}")
    return "; ".join(errors)


def check_topic(topic: KafkaTopic, timeout: float | None = None) -> None:
    """Raise unless the cluster answers within the timeout and holds ``topic``."""
    timeout = timeout_s() if timeout is None else timeout
    why, topics = probe(topic, timeout)
    if why is not None:
        raise KafkaUnreachable(_unreachable(topic, timeout, why))
    if topics is not None and topic.topic not in topics:
        known = sorted(t for t in topics if not t.startswith("__"))
        shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "") if known else "none"
        raise KafkaConfigError(
            f"Kafka topic {topic.topic} does not exist at {topic.bootstrap} (topics there: {shown}): check "
            "--kafka-topic, or create the topic first (rulewatch kafka topic, or the cluster's own tools)"
        )


@dataclass
class Outage:
    started: float  # time.time() of the first unanswered probe
    ended: float | None = None  # of the first answered one after it; None: still down

    def seconds(self, now: float | None = None) -> float:
        return (self.ended if self.ended is not None else now if now is not None else time.time()) - self.started


@dataclass
class Watch:
    """Probes the cluster every ``every`` seconds in a thread and records outages.

    ``on_change(text)`` is told when the cluster stops answering and when it answers again.
    """

    topic: KafkaTopic
    on_change: Callable[[str], None]
    every: float = PROBE_EVERY_S
    timeout: float = field(default_factory=lambda: min(timeout_s(), 10.0))
    outages: list[Outage] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def down(self) -> Outage | None:
        """The outage going on now, if any."""
        return self.outages[-1] if self.outages and self.outages[-1].ended is None else None

    def check(self) -> None:
        """One probe; a change of state is recorded and told."""
        why, _ = probe(self.topic, self.timeout)
        now = time.time()
        if why is not None and self.down is None:
            self.outages.append(Outage(now))
            self.on_change(
                f"WARNING: Kafka at {self.topic.bootstrap} is not answering ({why}); nothing is ingested while it is "
                "down; retrying"
            )
        elif why is None and (outage := self.down) is not None:
            outage.ended = now
            self.on_change(
                f"Kafka at {self.topic.bootstrap} answers again after {outage.seconds():.0f}s; what was sent to "
                f"{self.topic.topic} meanwhile is read now"
            )

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._loop, name="rulewatch-kafka-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 1)

    def summary(self) -> str | None:
        """One line about the run's outages (None: there were none)."""
        if not self.outages:
            return None
        total = sum(o.seconds() for o in self.outages)
        still = " and is still not answering" if self.down else ""
        return f"Kafka at {self.topic.bootstrap} did not answer for {total:.0f}s in {len(self.outages)} outage(s){still}"
