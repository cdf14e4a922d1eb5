"""``rulewatch generate``: live transaction traffic with labelled fraud patterns, at a steady rate.

Background traffic is many payers, beneficiaries, users and IPs, built so that it can never cross
the fixture rules (fixtures/rules.json + fixtures/live_rules.json): every background payer pays at
most ``PAYER_USES`` times, each payment at most ``MAX_BACKGROUND_AMOUNT`` (so no payer reaches 5
payments, no payer/beneficiary pair passes 1000), and every background user and IP logs in at most
``LOGIN_USES`` times (so no user sees more than 4 IPs and no IP more than 4 users). Any alert on
background traffic is therefore a false positive of the pipeline, not of the data.

Injected patterns, one instance every ``pattern_every`` seconds in turn, each on fresh ids:

- ``drain``: a payer drains their account into one beneficiary. Compressed scenario: a day of
  transfers every 6 hours is replayed with 6 h -> ``DRAIN_STEP_S`` seconds, four transfers of
  ~260 that pass the 1000-per-hour SUM of rule 1 only together (the fourth alerts).
- ``burst``: eight small payments from one payer within two seconds (rule 2, COUNT >= 5 in 10 min).
- ``password_spray``: one account logged into from eight IPs (rule 3, > 4 distinct IPs per user).
- ``login_attack``: one IP logging into eight accounts (rule 5, > 4 distinct users per IP).

Event time is the wall clock at generation, so event time -> alert is true end-to-end latency.
Files are written under a hidden name and renamed, so the file source never sees half a file;
labels go to a separate folder (outside the landing folder) for scoring detections.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from rulewatch.spark.storage.lakehouse import write_whole

PAYER_USES = 4
MAX_BACKGROUND_AMOUNT = 249.99  # PAYER_USES x this stays below rule 1's limit of 1000
LOGIN_USES = 3  # distinct IPs per user and users per IP stay below rules 3 and 5 (> 4)
POOL_BLOCK = 2048  # ids per pool block: each id's uses are spread over that block's draws
LOGIN_SHARE = 0.3
PAYMENT_TYPES = ("CSH", "CRD")  # the types silver accepts by default (silver.DEFAULT_PAYMENT_TYPES)
PAYMENT_TYPE_WEIGHTS = (0.3, 0.7)
BENEFICIARIES = 50_000

DRAIN_STEP_S = 3.0
PATTERN_STEP_S = 0.25
PATTERN_EVENTS = 8

# The rule each pattern is meant to trip (fixtures/rules.json, fixtures/live_rules.json).
PATTERN_RULES = {"drain": 1, "burst": 2, "password_spray": 3, "login_attack": 5}
PATTERNS = tuple(PATTERN_RULES)


@dataclass(frozen=True)
class GeneratorConfig:
    rate: float = 1000.0  # events per second, background and patterns together
    duration: float = 60.0  # seconds of traffic
    seed: int = 7
    run_id: str = "0"  # hex, part of every id, so runs never share transaction ids or keys
    file_interval: float = 0.2  # seconds between landing files
    pattern_every: float = 5.0  # seconds between injected pattern instances; 0 injects none

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be above 0 events/s, got {self.rate}")
        if not self.duration > 0:
            raise ValueError(f"--duration must be above 0 seconds, got {self.duration}")
        if not 0.01 <= self.file_interval <= 60:
            raise ValueError(f"--file-interval must be between 0.01 and 60 seconds, got {self.file_interval}")
        if self.pattern_every < 0:
            raise ValueError(f"--pattern-every must be 0 (no patterns) or more seconds, got {self.pattern_every}")
        if not (1 <= len(self.run_id) <= 8 and all(c in "0123456789abcdef" for c in self.run_id)):
            raise ValueError(f"--run-id must be 1 to 8 lowercase hex digits, got {self.run_id!r}")


@dataclass(frozen=True)
class Label:
    """One injected pattern instance: the rule meant to catch it and the key it should fire on."""

    pattern: str
    instance: int
    rule_id: int
    key: dict[str, str]  # rule grouping field -> value
    transaction_ids: list[str] = field(default_factory=list)
    start_ms: int = 0

    @property
    def group_key(self) -> str:
        return group_key(self.key.values())


def group_key(parts: Any) -> str:
    """A key as gold writes it (keying.fan_out): values joined by '|', with '|' and '\\' escaped."""
    return "|".join(str(p).replace("\\", "\\\\").replace("|", "\\|") for p in parts)


class _Pool:
    """Ids each drawn exactly ``uses`` times, shuffled within blocks so reuse looks like traffic."""

    def __init__(self, make_id: Callable[[int], str], uses: int, rng: random.Random) -> None:
        self._make_id, self._uses, self._rng = make_id, uses, rng
        self._pending: deque[str] = deque()
        self._next_block = 0

    def draw(self) -> str:
        if not self._pending:
            base = self._next_block * POOL_BLOCK
            block = [self._make_id(base + i) for i in range(POOL_BLOCK) for _ in range(self._uses)]
            self._rng.shuffle(block)
            self._pending.extend(block)
            self._next_block += 1
        return self._pending.popleft()


def _ip(run_id: str, kind: int, n: int) -> str:
    # IPv6 documentation prefix: unique per run, kind (background / attacker / spray source) and n.
    run = run_id.zfill(8)
    return f"2001:db8:{run[:4]}:{run[4:]}:{kind:x}:{n >> 16:x}::{n & 0xFFFF:x}"


class Generator:
    """Deterministic event source: ``tick`` returns what is due by an elapsed time, stamped with a clock.

    Background events follow ``rate`` exactly (cumulatively), pattern steps their schedule;
    pattern events count towards the rate.
    """

    def __init__(self, config: GeneratorConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        run = config.run_id
        self._payers = _Pool(lambda n: f"payer-{run}-{n}", PAYER_USES, self._rng)
        self._users = _Pool(lambda n: f"user-{run}-{n}", LOGIN_USES, self._rng)
        self._ips = _Pool(lambda n: _ip(run, 0, n), LOGIN_USES, self._rng)
        self._emitted = 0  # every event, background and pattern: what the rate counts
        self._background_ids = 0
        self._instances_started = 0
        self._due: list[tuple[float, dict[str, Any]]] = []  # (elapsed seconds, event without time), by time

    @property
    def emitted(self) -> int:
        return self._emitted

    def _background(self) -> dict[str, Any]:
        self._background_ids += 1
        txn = {"transactionId": f"{self.config.run_id}-{self._background_ids:09d}"}
        if self._rng.random() < LOGIN_SHARE:
            action = "login" if self._rng.random() < 0.9 else "logout"
            return {**txn, "userId": self._users.draw(), "ip": self._ips.draw(), "action": action}
        amount = min(MAX_BACKGROUND_AMOUNT, max(1.0, round(self._rng.lognormvariate(3.7, 0.9), 2)))
        return {
            **txn,
            "payeeId": self._payers.draw(),
            "beneficiaryId": f"ben-{self._rng.randrange(BENEFICIARIES)}",
            "paymentAmount": f"{amount:.2f}",
            "paymentType": self._rng.choices(PAYMENT_TYPES, PAYMENT_TYPE_WEIGHTS)[0],
        }

    def _pattern(self, instance: int) -> tuple[str, dict[str, str], list[tuple[float, dict[str, Any]]]]:
        """One instance of pattern ``PATTERNS[instance % 4]``: its kind, key and (offset s, event) steps."""
        kind = PATTERNS[instance % len(PATTERNS)]
        run, rng = self.config.run_id, self._rng
        steps: list[tuple[float, dict[str, Any]]]
        if kind == "drain":
            key = {"payeeId": f"drainer-{run}-{instance}", "beneficiaryId": f"mule-{run}-{instance}"}
            steps = [(i * DRAIN_STEP_S, {**key, "paymentAmount": f"{rng.uniform(260, 320):.2f}", "paymentType": "CSH"})
                     for i in range(4)]  # fmt: skip
        elif kind == "burst":
            key = {"payeeId": f"burster-{run}-{instance}"}
            steps = [(i * PATTERN_STEP_S, {**key, "beneficiaryId": f"ben-{rng.randrange(BENEFICIARIES)}",
                      "paymentAmount": f"{rng.uniform(1, 9.99):.2f}", "paymentType": "CRD"})
                     for i in range(PATTERN_EVENTS)]  # fmt: skip
        elif kind == "password_spray":
            key = {"userId": f"sprayed-{run}-{instance}"}
            steps = [(i * PATTERN_STEP_S, {**key, "ip": _ip(run, 2, instance * PATTERN_EVENTS + i), "action": "login"})
                     for i in range(PATTERN_EVENTS)]  # fmt: skip
        else:
            key = {"ip": _ip(run, 1, instance)}
            steps = [(i * PATTERN_STEP_S, {**key, "userId": f"victim-{run}-{instance}-{i}", "action": "login"})
                     for i in range(PATTERN_EVENTS)]  # fmt: skip
        # Pattern ids have their own namespace so a label lists them before they are emitted.
        steps = [(offset, {"transactionId": f"{run}-p{instance}-{i}", **event}) for i, (offset, event) in enumerate(steps)]
        return kind, key, steps

    def _start_patterns(self, elapsed: float, now_ms: int) -> list[Label]:
        """Schedule every instance whose start is due, skipping any that could not finish within the duration."""
        every, labels = self.config.pattern_every, []
        while every and (self._instances_started + 1) * every <= elapsed:
            instance = self._instances_started
            start = (instance + 1) * every
            kind, key, steps = self._pattern(instance)
            self._instances_started += 1
            if start + steps[-1][0] > self.config.duration:
                continue
            self._due.extend((start + offset, event) for offset, event in steps)
            ids = [event["transactionId"] for _, event in steps]
            labels.append(Label(kind, instance, PATTERN_RULES[kind], key, ids, now_ms))
        self._due.sort(key=lambda item: item[0])
        return labels

    def tick(self, elapsed: float, now_ms: int) -> tuple[list[dict[str, Any]], list[Label]]:
        """Events due by ``elapsed`` seconds into the run, all with event time ``now_ms``, and labels of
        the pattern instances that started."""
        elapsed = min(elapsed, self.config.duration)
        labels = self._start_patterns(elapsed, now_ms)
        events: list[dict[str, Any]] = []
        while self._due and self._due[0][0] <= elapsed:
            events.append(self._due.pop(0)[1])
        target = max(int(self.config.rate * elapsed), self._emitted + len(events))
        events += [self._background() for _ in range(target - self._emitted - len(events))]
        self._emitted += len(events)
        return [{**event, "eventTime": now_ms} for event in events], labels

    @property
    def finished(self) -> bool:
        return not self._due and self._emitted >= int(self.config.rate * self.config.duration)


def check_folders(landing: Path, labels: Path) -> None:
    """Labels must not land where the pipeline reads transactions, nor the other way round."""
    landing, labels = landing.resolve(), labels.resolve()
    if labels == landing or landing in labels.parents:
        raise ValueError(f"labels folder {labels} is inside the landing folder {landing}; put it beside it")
    if labels in landing.parents:
        raise ValueError(f"landing folder {landing} is inside the labels folder {labels}; use separate folders")


@dataclass
class GenerateResult:
    events: int
    files: int
    labels: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


# Where a tick's events go: ``(name, events)``; a folder gets one file per tick, a topic one record per event.
Emit = Callable[[str, list[dict[str, Any]]], None]


def to_folder(landing: Path) -> Emit:
    """Land each tick's events as one JSON-lines file, written whole (landing contract)."""
    landing.mkdir(parents=True, exist_ok=True)

    def emit(name: str, events: list[dict[str, Any]]) -> None:
        write_whole(landing / name, "".join(json.dumps(event, separators=(",", ":")) + "\n" for event in events))

    return emit


def run(
    config: GeneratorConfig,
    landing: Path | Emit,
    labels: Path,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
) -> GenerateResult:
    """Land ``config.rate`` events/s into ``landing`` for ``config.duration`` seconds (or until ``stop``).

    ``landing``: a folder, or an ``Emit`` (kafka/produce.py sends to a topic). Everything due by
    each ``file_interval`` goes out together (one file); a tick that carries the start of a pattern
    instance gets a labels file of the same name in ``labels``.
    """
    if isinstance(landing, Path):
        check_folders(landing, labels)
        landing = to_folder(landing)
    labels.mkdir(parents=True, exist_ok=True)
    stop = stop or threading.Event()
    generator = Generator(config)
    started = clock()
    ticks = files = labelled = 0
    while not generator.finished and not stop.is_set():
        now = clock()
        events, new_labels = generator.tick(now - started, int(now * 1000))
        name = f"{config.run_id}-{ticks:06d}.jsonl"
        ticks += 1
        if new_labels:
            write_whole(labels / name, "".join(json.dumps(asdict(label)) + "\n" for label in new_labels))
            labelled += len(new_labels)
        if events:
            landing(name, events)
            files += 1
        stop.wait(max(0.0, started + ticks * config.file_interval - clock()))
    return GenerateResult(generator.emitted, files, labelled, clock() - started)


def read_labels(labels: Path) -> list[Label]:
    """Every label written into ``labels`` (hidden half-written files are skipped)."""
    out = []
    for path in sorted(labels.glob("[!.]*.jsonl")):
        out += [Label(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return out


def new_run_id() -> str:
    """Eight hex digits from the clock (tenths of a second): runs on one landing folder never share ids."""
    return f"{int(time.time() * 10) & 0xFFFFFFFF:08x}"
