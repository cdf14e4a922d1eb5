"""A real Apache Kafka broker on loopback, started and stopped by the project (``rulewatch kafka start|stop``).

One JVM in KRaft combined mode (broker and controller), from the Kafka jars resolved once from
Maven Central with the Ivy that pyspark ships and reused offline afterwards, like the Delta jars.
Everything lives in one folder: the config, the data (so a restart keeps topics and offsets), the
log and the pid. Listens on 127.0.0.1 only; plaintext, for laptops and tests.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rulewatch.spark.runtime.env import cache_home, java_binary

KAFKA_VERSION = "4.1.1"
# The broker logs through slf4j 1.7; without a binding it would log nothing at all, start-up errors included.
_IVY_MODULE = f"""<ivy-module version="2.0">
  <info organisation="rulewatch" module="kafka-broker"/>
  <dependencies>
    <dependency org="org.apache.kafka" name="kafka_2.13" rev="{KAFKA_VERSION}" conf="default"/>
    <dependency org="org.apache.logging.log4j" name="log4j-slf4j-impl" rev="2.24.3" conf="default"/>
  </dependencies>
</ivy-module>
"""
_LOG4J = """status = warn
appender.file.type = Console
appender.file.name = console
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.console.ref = console
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
"""


class BrokerError(RuntimeError):
    """The local broker cannot start or be reached: says why and what to do."""


@dataclass(frozen=True)
class Broker:
    bootstrap: str
    pid: int
    directory: Path

    @property
    def log(self) -> Path:
        return self.directory / "broker.log"


def jars_dir() -> Path:
    return cache_home() / "jars" / f"kafka_2.13-{KAFKA_VERSION}"


def broker_jars() -> list[Path]:
    """The broker's classpath; empty when it has not been fetched yet."""
    directory = jars_dir()
    return sorted(directory.glob("*.jar")) if (directory / "COMPLETE").exists() else []


def _ivy_jar() -> Path:
    import pyspark

    found = sorted((Path(pyspark.__file__).parent / "jars").glob("ivy-*.jar"))
    if not found:
        raise BrokerError("pyspark's Ivy jar (pyspark/jars/ivy-*.jar) is missing; reinstall with `make setup`")
    return found[-1]


def _java() -> str:
    java = java_binary()
    if java is None:
        raise BrokerError("no java: set JAVA_HOME or put a JDK 17 or newer on PATH (the broker and Spark both need it)")
    return str(java)


def fetch_broker_jars(quiet: bool = False) -> list[Path]:
    """Resolve Kafka and its dependencies from Maven Central (once) into ``jars_dir()``."""
    if jars := broker_jars():
        return jars
    target = jars_dir()
    with tempfile.TemporaryDirectory(prefix="rulewatch-kafka-ivy-") as work:
        module = Path(work, "ivy.xml")
        module.write_text(_IVY_MODULE)
        if not quiet:
            print(f"rulewatch: fetching Apache Kafka {KAFKA_VERSION} from Maven Central (once) ...", flush=True)
        result = subprocess.run(
            [_java(), "-jar", str(_ivy_jar()), "-ivy", str(module), "-confs", "default", "-cache", str(Path(work, "cache")),
             "-retrieve", str(Path(work, "jars", "[organisation]_[artifact]-[revision](-[classifier]).[ext]"))],
            capture_output=True, text=True,
        )  # fmt: skip
        resolved = sorted(Path(work, "jars").glob("*.jar"))
        if result.returncode != 0 or not resolved:
            raise BrokerError(
                f"could not resolve Apache Kafka {KAFKA_VERSION} from Maven Central; is the network reachable?\n"
                + (result.stdout + result.stderr)[-2000:]
            )
        target.mkdir(parents=True, exist_ok=True)
        for jar in resolved:
            shutil.copy2(jar, target / jar.name)
    (target / "log4j2.properties").write_text(_LOG4J)
    (target / "COMPLETE").write_text(f"org.apache.kafka:kafka_2.13:{KAFKA_VERSION}\n")
    return broker_jars()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        # As the broker binds: connections of a broker just stopped (TIME_WAIT) do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) still answers signal 0.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _answers(bootstrap: str, timeout: float = 5) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - KafkaException and friends: not (yet) answering
        return False


def _properties(directory: Path, port: int, controller_port: int) -> str:
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(directory / "data"),
        "num.partitions": "2",
        "auto.create.topics.enable": "true",
        # One broker: every internal topic has one replica.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def running(directory: Path) -> Broker | None:
    """The broker this folder's pid file names, if it is alive and answering."""
    directory = Path(directory)
    try:
        state = json.loads((directory / "broker.json").read_text())
    except (OSError, ValueError):
        return None
    broker = Broker(state["bootstrap"], state["pid"], directory.resolve())
    return broker if _alive(broker.pid) and _answers(broker.bootstrap) else None


def start(directory: Path, port: int | None = None, timeout: float = 90) -> Broker:
    """Start a broker keeping everything in ``directory`` (or return the one already running there).

    ``port``: the client port; None reuses the folder's previous port, else picks a free one.
    """
    directory = Path(directory).resolve()
    if broker := running(directory):
        return broker
    directory.mkdir(parents=True, exist_ok=True)
    jars = broker_jars() or fetch_broker_jars()
    saved = json.loads((directory / "ports.json").read_text()) if (directory / "ports.json").exists() else {}
    port = port or saved.get("port") or _free_port()
    controller_port = saved.get("controller_port") or _free_port()
    for taken in (p for p in (port, controller_port) if _port_taken(p)):
        raise BrokerError(f"port {taken} on 127.0.0.1 is in use; stop what holds it or pass another --port")
    (directory / "ports.json").write_text(json.dumps({"port": port, "controller_port": controller_port}))
    config = directory / "server.properties"
    config.write_text(_properties(directory, port, controller_port))
    java, classpath = _java(), ":".join(str(j) for j in jars)
    log4j = f"-Dlog4j2.configurationFile={jars_dir() / 'log4j2.properties'}"
    if not (directory / "data" / "meta.properties").exists():
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # One id in 64 starts with "-": given as a separate argument, the tool's parser takes it for an option.
        formatted = subprocess.run(
            [java, log4j, "-cp", classpath, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config)],
            capture_output=True, text=True,
        )  # fmt: skip
        if formatted.returncode != 0:
            raise BrokerError(f"formatting the broker's storage in {directory / 'data'} failed:\n{formatted.stderr[-2000:]}")
    log = directory / "broker.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [java, "-Xms256m", "-Xmx512m", log4j, "-cp", classpath, "kafka.Kafka", str(config)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    broker = Broker(f"127.0.0.1:{port}", process.pid, directory)
    (directory / "broker.json").write_text(json.dumps({"bootstrap": broker.bootstrap, "pid": broker.pid}))
    deadline = time.monotonic() + timeout
    while not _answers(broker.bootstrap, timeout=2):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(directory)
            tail = log.read_text(errors="replace").splitlines()[-20:]
            raise BrokerError(f"the Kafka broker did not come up on {broker.bootstrap}; last lines of {log}:\n" + "\n".join(tail))
        time.sleep(0.5)
    return broker


def stop(directory: Path, timeout: float = 30) -> bool:
    """Stop the folder's broker (TERM, then KILL after ``timeout``); False when none was running."""
    state_file = Path(directory) / "broker.json"
    try:
        pid = json.loads(state_file.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return False
    state_file.unlink()
    if not _alive(pid):
        return False
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    return True
