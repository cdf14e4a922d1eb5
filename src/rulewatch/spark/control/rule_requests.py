"""Rule changes handed to the live stream that holds the lakehouse, so ``rules apply`` starts no Spark.

A stream (``rulewatch stream`` / ``demo``) already has a warm Spark session on the lakehouse: a MERGE
there takes a second or two, where a second Spark for ``rules apply`` takes ~40 s of two busy cores
and competes with the stream for them. So while a stream holds the lakehouse, ``rules apply`` leaves
its validated rules as a request file in ``<lakehouse>/_rule_requests`` and waits; the stream's
monitor loop (``monitor.follow``) claims each request by renaming it, applies it with
``rules_table.apply_rules`` and writes the answer beside it. A request nobody claims in time is
withdrawn, and ``rules apply`` applies the rules itself; a request whose sender has gone is dropped.
A local lakehouse only, like the lock that names the stream.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import SparkSession

from rulewatch.engine.rules import Rule, RuleSetError, parse_rules
from rulewatch.spark.control.rules_table import RuleChange, RulesConflict, apply_rules
from rulewatch.spark.storage.lakehouse import Lakehouse, lock_holder, write_whole

FOLDER = "_rule_requests"
# The commands whose monitor loop serves requests, as the lock file names them (lakehouse.exclusive).
SERVERS = ("(rulewatch stream)", "(rulewatch demo)")
# How long ``rules apply`` waits for the stream to claim its request: a stream still starting its
# queries claims nothing until its monitor loop runs.
CLAIM_TIMEOUT_S = 60.0
# And how much longer for its answer once claimed: a MERGE on a warm session takes seconds.
ANSWER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Answer:
    changes: list[RuleChange]
    error: str | None = None  # the apply failed: the message, nothing written
    server: str = ""  # who applied it (pid N)


def serves_requests(holder: str | None) -> bool:
    """Whether the lock holder ``holder`` (``lakehouse.lock_holder``) is a stream that answers requests."""
    return holder is not None and any(name in holder for name in SERVERS)


def _folder(lakehouse: Lakehouse) -> Path:
    return Path(lakehouse.root, FOLDER)


def ask(lakehouse: Lakehouse, rules: list[Rule], updated_by: str, claim_timeout: float = CLAIM_TIMEOUT_S) -> Answer | None:
    """Hand ``rules`` to the stream holding ``lakehouse`` and wait for its answer; None if it did
    not claim them within ``claim_timeout`` seconds or stopped first (the request is withdrawn:
    nothing applied)."""
    folder = _folder(lakehouse)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"  # sorted by name: served in the order sent
    request, claimed, answer = folder / f"{name}.json", folder / f"{name}.taken", folder / f"{name}.answer.json"
    body = {"rules": [rule.to_json() for rule in rules], "updated_by": updated_by, "pid": os.getpid(), "host": socket.gethostname()}
    write_whole(request, json.dumps(body))
    deadline = time.monotonic() + claim_timeout
    while not answer.exists():
        unclaimed = request.exists()
        if unclaimed and (time.monotonic() > deadline or lock_holder(lakehouse) is None):
            try:
                request.unlink()  # withdrawn before the stream took it
                return None
            except FileNotFoundError:
                continue  # claimed this moment: its answer follows
        if not unclaimed and not claimed.exists() and not answer.exists():
            return Answer([], "the stream dropped the request unapplied")
        if time.monotonic() > deadline + ANSWER_TIMEOUT_S or (claimed.exists() and lock_holder(lakehouse) is None and not answer.exists()):
            return Answer([], "the stream took the rules but gave no answer (it stopped, or is stuck): see what config/rules "
                          "holds now with `rulewatch rules export`, then apply the file again")  # fmt: skip
        time.sleep(0.2)
    stored = json.loads(answer.read_text(encoding="utf-8"))
    answer.unlink()
    changes = [RuleChange(rule_id, action, detail) for rule_id, action, detail in stored["changes"]]
    return Answer(changes, stored.get("error"), stored.get("server", ""))


def _sender_gone(body: dict) -> bool:
    """Whether the sender is known to have gone: only a process of this host can be asked."""
    pid = body.get("pid")
    if body.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        return False
    return False


def serve(spark: SparkSession, lakehouse: Lakehouse) -> list[str]:
    """Apply every pending request (in the order sent); one line for the log per request. Nothing a
    request holds can stop the stream: a file that is no request is set aside as ``.bad`` and named."""
    folder = _folder(lakehouse)
    if "://" in lakehouse.root or not folder.is_dir():
        return []
    said = []
    for request in sorted(p for p in folder.glob("*.json") if not p.name.endswith(".answer.json")):
        claimed = request.with_suffix(".taken")
        try:
            request.rename(claimed)
        except FileNotFoundError:  # withdrawn meanwhile
            continue
        except OSError as err:
            said.append(f"rules: cannot take the request {request.name} ({err.strerror}): left where it is")
            continue
        try:
            said.append(_answer(spark, lakehouse, claimed, request.with_name(f"{request.stem}.answer.json")))
        except Exception as err:  # not a request this module wrote: the stream goes on
            claimed.replace(claimed.with_suffix(".bad"))
            said.append(f"rules: {request.name} in {folder} is no rules request ({type(err).__name__}: {err}): set aside as .bad")
    return said


def _answer(spark: SparkSession, lakehouse: Lakehouse, claimed: Path, answer: Path) -> str:
    body = json.loads(claimed.read_text(encoding="utf-8"))
    if _sender_gone(body):
        claimed.unlink()
        return f"rules: dropped a request of `rules apply` (pid {body.get('pid')}), which has gone: nothing applied"
    who = str(body["updated_by"])
    changes: list[RuleChange] = []
    error = None
    try:
        changes = apply_rules(spark, lakehouse, parse_rules(body["rules"]), who)
    except (RuleSetError, RulesConflict) as err:
        error = str(err)
    except Exception as err:  # the stream must outlive any request: the sender reports it
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    write_whole(answer, json.dumps({"changes": [[c.rule_id, c.action, c.detail] for c in changes], "error": error, "server": f"pid {os.getpid()}"}))
    claimed.unlink()
    if error:
        return f"rules: `rules apply` by {who}: nothing written: {error}"
    return f"rules: applied for `rules apply` by {who}: " + "; ".join(str(c) for c in changes)
