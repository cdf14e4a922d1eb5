"""The deployed bundle job on a Databricks workspace: trigger and follow a run, read the latest alerts.

Everything here talks to a workspace through ``databricks-sdk``, configured the SDK's standard way
(``databricks.sdk.core.Config``: ``DATABRICKS_*`` environment variables or a ``~/.databrickscfg``
profile); nothing here holds a host or a secret, and nothing here parses that file itself. When the SDK
finds no usable configuration, the commands stop with the settings to give; that check reads only the
environment and the config file (the SDK contacts a host only once one is configured).

    rulewatch remote run [JOB] [--param K=V ...] [--no-follow] [--timeout-minutes N]
    rulewatch remote alerts --warehouse-id ID [--catalog C] [--schema S] [--volume V] [--limit N] [--profile P]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rulewatch.bundle import DEFAULT_JOB
from rulewatch.cli import arguments
from rulewatch.spark.storage.lakehouse import Lakehouse, table_ref

if TYPE_CHECKING:
    from databricks.sdk import WorkspaceClient
    from databricks.sdk.core import Config

Log = Callable[[str], None]

# The prod target's catalog/schema in databricks.yml and its lakehouse volume; a test keeps them in step.
DEFAULT_CATALOG = "main"
DEFAULT_SCHEMA = "rulewatch"
DEFAULT_VOLUME = "lakehouse"
MAX_ALERTS = 10_000

AUTH_HELP = (
    "Configure a Databricks workspace in one of the SDK's standard ways:\n"
    "  - environment: DATABRICKS_HOST=https://<workspace-host> plus DATABRICKS_TOKEN (personal access token),\n"
    "    or DATABRICKS_CLIENT_ID + DATABRICKS_CLIENT_SECRET (service principal OAuth);\n"
    "  - a profile in ~/.databrickscfg (DATABRICKS_CONFIG_FILE points elsewhere) with `host` and `token`, or one\n"
    "    written by `databricks auth login --host <workspace-host>`; choose it with --profile NAME or\n"
    "    DATABRICKS_CONFIG_PROFILE=NAME (without either the [DEFAULT] profile is used)."
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")


class RemoteError(Exception):
    """The workspace call cannot be made or did not succeed."""


class RemoteAuthError(RemoteError):
    """No usable Databricks authentication; the message says what to set."""


# ---- authentication --------------------------------------------------------------------------------


def workspace_config(profile: str | None = None) -> Config:
    """The SDK's own configuration (environment, then ``~/.databrickscfg``); ``RemoteAuthError`` if it has none.

    ``Config`` resolves host and credentials exactly as the Databricks CLI does, including the
    DATABRICKS_CONFIG_PROFILE / DATABRICKS_CONFIG_FILE variables; it raises ValueError for every
    configuration it cannot use (no host, no credentials, an unknown profile).
    """
    from databricks.sdk.core import Config

    try:
        return Config(profile=profile) if profile else Config()
    except ValueError as err:
        raise RemoteAuthError(f"no usable Databricks configuration: {err}\n{AUTH_HELP}") from err


def workspace_client(profile: str | None = None) -> WorkspaceClient:
    """A ``WorkspaceClient`` on :func:`workspace_config`."""
    from databricks.sdk import WorkspaceClient

    return WorkspaceClient(config=workspace_config(profile))


# ---- finding the deployed job -----------------------------------------------------------------------


@dataclass(frozen=True)
class DeployedJob:
    job_id: int
    name: str


def _bundle_job_name(key: str) -> str | None:
    """The ``name`` of bundle job ``key`` in this checkout's databricks.yml, if there is one."""
    from rulewatch.cli.jobs import JobError, load_bundle

    try:
        jobs = load_bundle().jobs
    except JobError:
        return None
    job = jobs.get(key)
    name = job.definition.get("name") if job else None
    return name if isinstance(name, str) else None


def match_jobs(wanted: Iterable[str], jobs: Iterable[DeployedJob]) -> list[DeployedJob]:
    """Deployed jobs whose name is one of ``wanted``, exactly or behind a bundle prefix like ``[dev alice] ``.

    Development-mode deployments prefix every name with ``[dev <user>] ``, so ``"rulewatch pipeline"``
    matches ``"[dev alice] rulewatch pipeline"`` but not ``"old rulewatch pipeline"``. Exact (full-name)
    matches win over prefixed ones, so giving the whole ``[dev alice] ...`` name picks that one.
    """
    names = [w.strip() for w in wanted if w and w.strip()]
    jobs = list(jobs)
    exact = [j for j in jobs if j.name in names]
    if exact:
        return exact
    prefixed = []
    for job in jobs:
        if job.name.startswith("[") and "] " in job.name:
            suffix = job.name.split("] ", 1)[1]
            if suffix in names:
                prefixed.append(job)
    return prefixed


def find_job(client: WorkspaceClient, job_name_or_id: str | int) -> DeployedJob:
    """The one deployed job meant by a job id, a bundle job key or a job name (prefix-tolerant)."""
    text = str(job_name_or_id).strip()
    if text.isdigit():
        job = client.jobs.get(int(text))
        return DeployedJob(int(text), (job.settings.name if job.settings else None) or text)
    wanted = [text]
    bundle_name = _bundle_job_name(text)
    if bundle_name:
        wanted.append(bundle_name)
    deployed = [
        DeployedJob(j.job_id, j.settings.name)
        for j in client.jobs.list()
        if j.job_id is not None and j.settings is not None and j.settings.name
    ]
    matches = match_jobs(wanted, deployed)
    if not matches:
        looked_for = " or ".join(repr(w) for w in dict.fromkeys(wanted))
        raise RemoteError(
            f"no deployed job named {looked_for} (optionally behind a '[dev <user>] ' prefix); "
            f"deploy it with `databricks bundle deploy -t dev`, or pass the job id"
        )
    if len(matches) > 1:
        listed = "; ".join(f"{m.job_id}: {m.name}" for m in matches)
        raise RemoteError(f"{len(matches)} deployed jobs match {text!r}: {listed}; pass the job id or the full name")
    return matches[0]


# ---- running and following ----------------------------------------------------------------------------


def _state_text(state: Any) -> str:
    """``RUNNING`` or ``TERMINATED SUCCESS`` from a RunState (jobs API), tolerating missing parts."""
    if state is None:
        return "UNKNOWN"
    life = state.life_cycle_state.value if state.life_cycle_state else "UNKNOWN"
    result = f" {state.result_state.value}" if state.result_state else ""
    return life + result


class _RunReporter:
    """Logs each task attempt's state changes and the run's, given successive ``Run`` snapshots."""

    def __init__(self, run_id: int, log: Log):
        self.run_id = run_id
        self.log = log
        self.seen: dict[tuple[str, int], str] = {}
        self.run_state = ""

    def __call__(self, run: Any) -> None:
        for task in run.tasks or []:
            # A retried task shows up once per attempt; report each attempt's transitions.
            attempt = task.attempt_number or 0
            text = _state_text(task.state)
            if self.seen.get((task.task_key, attempt)) != text:
                self.seen[(task.task_key, attempt)] = text
                label = f"{task.task_key}{f' (retry {attempt})' if attempt else ''}"
                failed = task.state and task.state.result_state and task.state.result_state.value != "SUCCESS"
                detail = f": {task.state.state_message}" if failed and task.state.state_message else ""
                self.log(f"  {label}: {text}{detail}")
        current = _state_text(run.state)
        if current != self.run_state:
            self.run_state = current
            self.log(f"run {self.run_id}: {current}")


def run_job(
    job_name_or_id: str | int | None,
    params: dict[str, str] | None = None,
    follow: bool = True,
    log: Log = print,
    *,
    profile: str | None = None,
    client: WorkspaceClient | None = None,
    timeout: timedelta = timedelta(hours=2),
) -> int:
    """Trigger the deployed job (``run_now``) and, with ``follow``, report each task's state changes.

    Following is the SDK's own waiter (``run_now(...).result(timeout, callback)``: it polls the run with
    back-off until it is TERMINATED or SKIPPED). Returns 0 when the run succeeded (or was only triggered,
    without ``follow``), 1 when it ended otherwise or was still running after ``timeout`` (it goes on in
    the workspace). Raises ``RemoteAuthError`` without any network call when no workspace is configured.
    """
    from databricks.sdk.errors import OperationFailed

    w = client or workspace_client(profile)
    job = find_job(w, job_name_or_id or DEFAULT_JOB)
    waiter = w.jobs.run_now(job.job_id, job_parameters=dict(params or {}) or None)
    run_id = waiter.run_id
    run = w.jobs.get_run(run_id)
    log(f"job {job.name} (id {job.job_id}): run {run_id} started{' ' + run.run_page_url if run.run_page_url else ''}")
    if not follow:
        return 0

    report = _RunReporter(run_id, log)
    report(run)
    try:
        # The waiter calls back with every non-final snapshot and returns the final one.
        final = waiter.result(timeout=timeout, callback=report)
    except TimeoutError:
        log(f"run {run_id}: still {report.run_state} after {timeout}; it goes on in the workspace")
        return 1
    except OperationFailed as err:  # INTERNAL_ERROR: the run cannot finish
        log(f"run {run_id}: {err}")
        return 1
    report(final)
    ok = bool(final.state and final.state.result_state and final.state.result_state.value == "SUCCESS")
    return 0 if ok else 1


# ---- reading alerts ------------------------------------------------------------------------------------


def validate_identifier(value: str, what: str = "identifier") -> str:
    """``value`` if it is a plain SQL identifier (letters, digits, underscore; not starting with a digit)."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a plain identifier (letters, digits and _, not starting with a digit, at most 255 characters)"
        )
    return value


def alerts_source(catalog: str, schema: str, volume: str = "") -> str:
    """The alerts table in SQL: the managed table ``catalog.schema.gold_alerts`` (the bundle's default,
    variable ``tables``), or with ``volume`` the Delta folder ``gold/alerts`` in that volume (``tables`` empty).

    A table name cannot be a parameter marker, so its parts are validated identifiers.
    """
    validate_identifier(catalog, "catalog"), validate_identifier(schema, "schema")
    if volume:
        return table_ref(Lakehouse("/Volumes/{}/{}/{}".format(catalog, schema, validate_identifier(volume, "volume"))).alerts)
    return table_ref(Lakehouse("/", schema=f"{catalog}.{schema}").alerts)


def alerts_statement(catalog: str, schema: str, volume: str = "") -> str:
    """The newest-alerts query over :func:`alerts_source`; ``:limit`` stays a parameter, as every user value."""
    return (
        "SELECT rule_id, group_key, transaction_id, event_time, aggregate_value, operator, `limit`, event_count, decision_time "
        f"FROM {alerts_source(catalog, schema, volume)} ORDER BY event_time DESC, alert_id LIMIT :limit"
    )


def latest_alerts(
    warehouse_id: str,
    catalog: str = DEFAULT_CATALOG,
    schema: str = DEFAULT_SCHEMA,
    limit: int = 20,
    *,
    volume: str = "",
    profile: str | None = None,
    client: WorkspaceClient | None = None,
    timeout_seconds: float = 120.0,
) -> list[dict[str, str | None]]:
    """The newest ``limit`` alerts (by event time) via the SQL Statement Execution API on ``warehouse_id``."""
    statement = alerts_statement(catalog, schema, volume)  # validates before anything is sent
    if not isinstance(limit, int) or not 1 <= limit <= MAX_ALERTS:
        raise ValueError(f"limit must be an integer from 1 to {MAX_ALERTS}, got {limit!r}")
    if not warehouse_id or not str(warehouse_id).strip():
        raise ValueError("a SQL warehouse id is needed (--warehouse-id; the bundle variable warehouse_id)")
    w = client or workspace_client(profile)
    from databricks.sdk.service.sql import StatementParameterListItem

    response = w.statement_execution.execute_statement(
        statement=statement,
        warehouse_id=str(warehouse_id).strip(),
        catalog=catalog,
        schema=schema,
        parameters=[StatementParameterListItem(name="limit", value=str(limit), type="INT")],
        wait_timeout="30s",
    )
    deadline = time.monotonic() + timeout_seconds
    while response.status and response.status.state and response.status.state.value in {"PENDING", "RUNNING"}:
        if time.monotonic() > deadline:
            w.statement_execution.cancel_execution(response.statement_id)
            raise RemoteError(f"statement {response.statement_id} still running after {timeout_seconds:.0f}s; cancelled")
        time.sleep(2)
        response = w.statement_execution.get_statement(response.statement_id)
    state = response.status.state.value if response.status and response.status.state else "UNKNOWN"
    if state != "SUCCEEDED":
        error = response.status.error.message if response.status and response.status.error else "no detail"
        raise RemoteError(f"alerts query {state}: {error}")
    columns = [c.name for c in (response.manifest.schema.columns or [])] if response.manifest and response.manifest.schema else []
    rows = response.result.data_array if response.result and response.result.data_array else []
    return [dict(zip(columns, row)) for row in rows]


# ---- command line --------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    print(f"rulewatch: {message}", file=sys.stderr)


def _api_errors() -> tuple[type[BaseException], ...]:
    from databricks.sdk.errors import DatabricksError

    return (DatabricksError,)


def _guarded(action: Callable[[], int]) -> int:
    """Run a remote command: 2 for bad input or no auth, 1 when the workspace says it failed."""
    try:
        return action()
    except (RemoteAuthError, ValueError) as err:
        _fail(str(err))
        return 2
    except RemoteError as err:
        _fail(str(err))
        return 1
    except _api_errors() as err:
        _fail(f"Databricks API: {err}")
        return 1


def cmd_remote_run(args: argparse.Namespace) -> int:
    """``remote run``: 0 when the run succeeded (or was started with --no-follow), 1 otherwise, 2 on bad setup."""

    def run() -> int:
        client = workspace_client(args.profile)
        return run_job(args.job, dict(args.param), follow=args.follow, client=client, timeout=timedelta(minutes=args.timeout_minutes))

    try:
        return _guarded(run)
    except KeyboardInterrupt:
        _fail("stopped following; the run goes on in the workspace (cancel it there or with `databricks jobs cancel-run`)")
        return 130


def cmd_remote_alerts(args: argparse.Namespace) -> int:
    """``remote alerts``: print the newest alerts; 0 on success, 1 on a failed query, 2 on bad input or setup."""

    def fetch() -> int:
        alerts_statement(args.catalog, args.schema, args.volume)  # reject bad identifiers before any auth
        client = workspace_client(args.profile)
        rows = latest_alerts(args.warehouse_id, args.catalog, args.schema, args.limit, volume=args.volume, client=client)
        print(f"{len(rows)} newest alerts in {alerts_source(args.catalog, args.schema, args.volume)}")
        for row in rows:
            print(
                f"  rule {row.get('rule_id')}  key {row.get('group_key') or '':<22} txn {row.get('transaction_id') or '':<10} "
                f"{row.get('event_time')}  {row.get('aggregate_value')} {row.get('operator')} {row.get('limit')}  "
                f"({row.get('event_count')} events)"
            )
        return 0

    return _guarded(fetch)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= MAX_ALERTS:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_ALERTS}, got {value}")
    return value


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected more than 0 minutes, got {text}")
    return value


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``remote run`` and ``remote alerts`` on the ``rulewatch`` parser."""
    remote = subparsers.add_parser("remote", help="the deployed bundle job on a Databricks workspace")
    remote_sub = remote.add_subparsers(dest="remote_command", required=True)

    run = remote_sub.add_parser("run", help="trigger the deployed job and follow its tasks to the end")
    run.add_argument("job", nargs="?", help=f"bundle job key, job name (a '[dev <user>] ' prefix is allowed) or job id (default: {DEFAULT_JOB})")
    run.add_argument("--param", type=arguments.key_value, action="append", default=[], metavar="K=V", help="job parameter for this run (repeatable)")
    run.add_argument("--no-follow", dest="follow", action="store_false", help="print the run id and URL and return at once")
    run.add_argument(
        "--timeout-minutes", type=_positive_minutes, default=120, help="stop following (exit 1) after this long; the run goes on (default: 120)"
    )
    run.add_argument("--profile", help="~/.databrickscfg profile (default: DATABRICKS_CONFIG_PROFILE, else the environment or [DEFAULT])")
    run.set_defaults(func=arguments.command("rulewatch.cli.remote:cmd_remote_run", "remote"))

    alerts = remote_sub.add_parser("alerts", help="the newest alerts, read through a SQL warehouse")
    alerts.add_argument("--warehouse-id", required=True, help="SQL warehouse id (the bundle variable warehouse_id)")
    alerts.add_argument("--catalog", default=DEFAULT_CATALOG, help=f"catalog of the rulewatch tables (default: {DEFAULT_CATALOG})")
    alerts.add_argument("--schema", default=DEFAULT_SCHEMA, help=f"schema of the rulewatch tables (default: {DEFAULT_SCHEMA})")
    alerts.add_argument(
        "--volume",
        default="",
        help="read gold/alerts as a Delta folder in this volume of the schema, for a deploy with the bundle variable tables empty "
        "(default: the managed table <catalog>.<schema>.gold_alerts)",
    )
    alerts.add_argument("--limit", type=_positive_int, default=20, help="how many alerts (default: 20)")
    alerts.add_argument("--profile", help="~/.databrickscfg profile (default: DATABRICKS_CONFIG_PROFILE, else the environment or [DEFAULT])")
    alerts.set_defaults(func=arguments.command("rulewatch.cli.remote:cmd_remote_alerts", "remote"))
