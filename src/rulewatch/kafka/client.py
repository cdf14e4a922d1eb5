"""Where a Kafka topic is and how to log in to it; the same settings for Spark and for Python clients.

Credentials never live in the repo or in job parameters: locally they come from the environment
(``RULEWATCH_KAFKA_SASL_USERNAME`` / ``RULEWATCH_KAFKA_SASL_PASSWORD``), on Databricks from a
secret scope (keys ``kafka-sasl-username`` / ``kafka-sasl-password``). Without either the client
connects in plaintext, as to the local broker (``rulewatch kafka start``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

USERNAME_ENV = "RULEWATCH_KAFKA_SASL_USERNAME"
PASSWORD_ENV = "RULEWATCH_KAFKA_SASL_PASSWORD"
MECHANISM_ENV = "RULEWATCH_KAFKA_SASL_MECHANISM"
PROTOCOL_ENV = "RULEWATCH_KAFKA_SECURITY_PROTOCOL"
SECRET_KEYS = ("kafka-sasl-username", "kafka-sasl-password")


class KafkaConfigError(ValueError):
    """A Kafka setting is missing or malformed: names it and the fix."""


@dataclass(frozen=True)
class KafkaTopic:
    """A topic on a cluster, and the Databricks secret scope holding its credentials (if any)."""

    bootstrap: str
    topic: str
    secret_scope: str | None = None

    def __post_init__(self) -> None:
        if not self.bootstrap.strip():
            raise KafkaConfigError("Kafka bootstrap servers are empty; give host:port[,host:port...] (e.g. 127.0.0.1:9092)")
        for server in self.bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise KafkaConfigError(f"Kafka bootstrap server {server.strip()!r} is not host:port (e.g. 127.0.0.1:9092)")
        if not self.topic or any(c not in _TOPIC_CHARS for c in self.topic) or len(self.topic) > 249:
            raise KafkaConfigError(
                f"Kafka topic {self.topic!r} is not a valid topic name: 1-249 characters of letters, digits, '.', '_' and '-'"
            )


_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class _Login:
    protocol: str
    mechanism: str
    username: str
    password: str


def _login(topic: KafkaTopic) -> _Login | None:
    """SASL credentials for the topic's cluster, or None for plaintext."""
    if topic.secret_scope:
        # Runtime dbutils on Databricks; elsewhere the SDK reads the scope through the workspace API.
        from databricks.sdk import WorkspaceClient

        secrets = WorkspaceClient().dbutils.secrets
        username, password = secrets.get(topic.secret_scope, SECRET_KEYS[0]), secrets.get(topic.secret_scope, SECRET_KEYS[1])
    else:
        username, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
        if bool(username) != bool(password):
            raise KafkaConfigError(f"set both {USERNAME_ENV} and {PASSWORD_ENV} (or neither, for a plaintext broker)")
        if not username or not password:
            return None
    return _Login(os.environ.get(PROTOCOL_ENV, "SASL_SSL"), os.environ.get(MECHANISM_ENV, "PLAIN"), username, password)


def _jaas(login: _Login, shaded: bool) -> str:
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    module = "plain.PlainLoginModule" if login.mechanism == "PLAIN" else "scram.ScramLoginModule"
    # Databricks runtimes shade the Kafka client under kafkashaded.
    prefix = "kafkashaded." if shaded else ""
    return f"{prefix}org.apache.kafka.common.security.{module} required username={quoted(login.username)} password={quoted(login.password)};"


def spark_options(topic: KafkaTopic) -> dict[str, str]:
    """``kafka.*`` options for Spark's Kafka source and sink."""
    from rulewatch.spark.runtime.env import is_databricks

    options = {"kafka.bootstrap.servers": topic.bootstrap}
    if login := _login(topic):
        jaas = _jaas(login, shaded=is_databricks())
        options |= {"kafka.security.protocol": login.protocol, "kafka.sasl.mechanism": login.mechanism, "kafka.sasl.jaas.config": jaas}
    return options


def client_config(topic: KafkaTopic) -> dict[str, str]:
    """librdkafka settings for the Python producer and consumer (confluent-kafka)."""
    config = {"bootstrap.servers": topic.bootstrap}
    if login := _login(topic):
        config |= {"security.protocol": login.protocol, "sasl.mechanism": login.mechanism,
                   "sasl.username": login.username, "sasl.password": login.password}  # fmt: skip
    return config


def ensure_topic(topic: KafkaTopic, partitions: int = 2, timeout: float = 30) -> None:
    """Create the topic unless it exists (an existing topic keeps its partitions)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_config(topic))  # held until the result: a collected client cancels its requests
    future = admin.create_topics([NewTopic(topic.topic, partitions, 1)], operation_timeout=timeout)[topic.topic]
    try:
        future.result(timeout)
    except KafkaException as err:
        if err.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise KafkaConfigError(f"could not create topic {topic.topic} on {topic.bootstrap}: {err.args[0].str()}") from None
