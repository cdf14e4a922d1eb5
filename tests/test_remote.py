"""``rulewatch remote``: what can be checked without a Databricks workspace.

No workspace is reachable from here, so these tests stop at the boundary: with no configuration
both commands fail fast with the settings to give and open no connection; authentication is the SDK's
own ``Config`` on a real config file; job-name matching, SQL identifier validation and the statement
handling are checked against stand-ins that return the SDK's own response classes; following a run is
the SDK's real ``JobsAPI`` waiter over a stand-in for its HTTP client (the workspace boundary).
"""

from __future__ import annotations

import argparse
import socket
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from databricks.sdk.service.sql import StatementResponse

from conftest import ROOT
from rulewatch.cli import remote
from rulewatch.cli.jobs import load_bundle
from rulewatch.cli.remote import (
    DeployedJob,
    RemoteAuthError,
    RemoteError,
    add_cli,
    alerts_statement,
    find_job,
    latest_alerts,
    match_jobs,
    run_job,
    validate_identifier,
    workspace_config,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rulewatch")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.fixture
def no_databricks_config(monkeypatch, tmp_path):
    """No DATABRICKS_* variable, an empty HOME (so no ~/.databrickscfg), and every connection attempt recorded."""
    import os

    for name in list(os.environ):
        if name.startswith("DATABRICKS_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return SimpleNamespace(home=home, attempts=attempts)


@pytest.mark.parametrize(
    "argv",
    [
        ["remote", "run"],
        ["remote", "run", "rulewatch_pipeline", "--param", "landing=/Volumes/x/y/z"],
        ["remote", "alerts", "--warehouse-id", "abc123"],
    ],
)
def test_commands_without_configuration_fail_fast_with_the_settings_to_give(no_databricks_config, capsys, argv):
    args = _parser().parse_args(argv)
    started = time.monotonic()
    code = args.func(args)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code != 0
    assert "DATABRICKS_HOST" in err and "DATABRICKS_TOKEN" in err
    assert "~/.databrickscfg" in err and "DATABRICKS_CONFIG_PROFILE" in err
    assert not no_databricks_config.attempts, "tried to open a connection"
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_functions_raise_the_auth_error_before_any_call(no_databricks_config):
    with pytest.raises(RemoteAuthError, match="DATABRICKS_HOST"):
        run_job("rulewatch_pipeline", {})
    with pytest.raises(RemoteAuthError, match="databrickscfg"):
        latest_alerts("abc123", "main", "rulewatch")
    assert not no_databricks_config.attempts


def test_an_unknown_profile_is_reported_by_the_sdk_without_a_network_call(no_databricks_config):
    (no_databricks_config.home / ".databrickscfg").write_text("[staging]\nhost = https://staging.example.invalid\ntoken = x\n")
    with pytest.raises(RemoteAuthError) as info:
        workspace_config("nope")
    assert "nope" in str(info.value) and "DATABRICKS_CONFIG_PROFILE" in str(info.value)
    assert not no_databricks_config.attempts


def test_a_profile_in_the_config_file_configures_the_sdk(no_databricks_config, monkeypatch):
    # The SDK reads the file itself; with a host it also probes the host's metadata, which is the
    # workspace boundary: refused here (recorded), after which the SDK falls back to the profile.
    (no_databricks_config.home / ".databrickscfg").write_text(
        "[staging]\nhost = https://staging.example.invalid\ntoken = x\nretry_timeout_seconds = 1\n"
    )
    started = time.monotonic()
    config = workspace_config("staging")
    assert (config.host, config.auth_type) == ("https://staging.example.invalid", "pat")
    monkeypatch.setenv("DATABRICKS_CONFIG_PROFILE", "staging")
    assert workspace_config().host == "https://staging.example.invalid"
    assert time.monotonic() - started < 30


def test_the_sdks_configuration_error_is_reported_with_the_help(no_databricks_config, monkeypatch):
    import databricks.sdk.core

    def failing_config(**kwargs):
        raise ValueError("default auth: cannot configure default credentials")

    monkeypatch.setattr(databricks.sdk.core, "Config", failing_config)
    with pytest.raises(RemoteAuthError) as info:
        remote.workspace_client()
    assert "cannot configure default credentials" in str(info.value) and "DATABRICKS_TOKEN" in str(info.value)


# ---- job-name matching ------------------------------------------------------------------------------

PIPELINE = "rulewatch pipeline (bronze -> silver -> gold)"


def test_bundle_key_resolves_to_the_declared_job_name():
    assert remote._bundle_job_name("rulewatch_pipeline") == load_bundle(ROOT).jobs["rulewatch_pipeline"].definition["name"] == PIPELINE
    assert remote._bundle_job_name("no_such_job") is None


def test_match_by_exact_name_or_behind_a_dev_prefix():
    prod = DeployedJob(1, PIPELINE)
    alice = DeployedJob(2, f"[dev alice] {PIPELINE}")
    other = DeployedJob(3, f"old {PIPELINE}")
    renamed = DeployedJob(4, f"[dev alice] {PIPELINE} v2")
    assert match_jobs([PIPELINE], [alice, other, renamed]) == [alice]
    assert match_jobs([PIPELINE], [prod, alice]) == [prod]  # the exact name wins
    assert match_jobs([f"[dev alice] {PIPELINE}"], [prod, alice]) == [alice]
    assert match_jobs(["rulewatch"], [prod, alice, other]) == []
    bob = DeployedJob(5, f"[dev bob] {PIPELINE}")
    assert match_jobs([PIPELINE], [alice, bob]) == [alice, bob]


class FakeApi:
    """The SDK's HTTP client as the jobs API sees it: canned JSON for jobs/list, jobs/get, run-now and runs/get."""

    def __init__(self, jobs: list[tuple[int, str]], runs: list[dict] | None = None):
        self._cfg = SimpleNamespace(workspace_id=None)
        self.jobs = [{"job_id": i, "settings": {"name": n}} for i, n in jobs]
        self.runs = list(runs or [])
        self.run_now_bodies: list[dict] = []
        self.run_gets = 0

    def do(self, method, path, query=None, body=None, headers=None, **kwargs):
        if path.endswith("/jobs/list"):
            return {"jobs": self.jobs}
        if path.endswith("/jobs/get"):
            return next(j for j in self.jobs if j["job_id"] == int(query["job_id"]))
        if path.endswith("/jobs/run-now"):
            self.run_now_bodies.append(body)
            return {"run_id": 77, "number_in_job": 1}
        if path.endswith("/jobs/runs/get"):
            assert int(query["run_id"]) == 77
            self.run_gets += 1
            return self.runs.pop(0) if len(self.runs) > 1 else self.runs[0]
        raise AssertionError(f"unexpected call {method} {path}")


def _client(api: FakeApi) -> SimpleNamespace:
    from databricks.sdk.mixins.jobs import JobsExt

    return SimpleNamespace(jobs=JobsExt(api))  # the class WorkspaceClient.jobs is


@pytest.fixture
def no_sleep(monkeypatch):
    """The SDK's waiter sleeps between polls (with back-off); these runs are canned, so it need not."""
    import databricks.sdk.service.jobs as jobs_service

    monkeypatch.setattr(jobs_service.time, "sleep", lambda _: None)


def test_find_job_by_key_name_or_id():
    client = _client(FakeApi([(11, "something else"), (12, f"[dev alice] {PIPELINE}")]))
    assert find_job(client, "rulewatch_pipeline") == DeployedJob(12, f"[dev alice] {PIPELINE}")
    assert find_job(client, PIPELINE).job_id == 12
    assert find_job(client, "11") == DeployedJob(11, "something else")


def test_find_job_refuses_to_guess():
    client = _client(FakeApi([(12, f"[dev alice] {PIPELINE}"), (13, f"[dev bob] {PIPELINE}")]))
    with pytest.raises(RemoteError, match=r"2 deployed jobs match.*12: \[dev alice\].*13: \[dev bob\]"):
        find_job(client, "rulewatch_pipeline")
    with pytest.raises(RemoteError, match="no deployed job named.*bundle deploy"):
        find_job(_client(FakeApi([(11, "other")])), "rulewatch_pipeline")


def _run(life: str, result: str | None = None, tasks: dict[str, tuple[str, str | None]] | None = None) -> dict:
    def state(life, result):
        return {"life_cycle_state": life, **({"result_state": result} if result else {}), "state_message": "boom" if result == "FAILED" else ""}

    return {
        "run_id": 77,
        "run_page_url": "https://example.invalid/#job/12/run/77",
        "state": state(life, result),
        "tasks": [{"task_key": k, "state": state(*v)} for k, v in (tasks or {}).items()],
    }


def test_run_job_follows_task_transitions_to_success_with_the_sdk_waiter(no_sleep):
    runs = [
        _run("PENDING", tasks={"setup": ("PENDING", None), "bronze": ("BLOCKED", None)}),
        _run("RUNNING", tasks={"setup": ("RUNNING", None), "bronze": ("BLOCKED", None)}),
        _run("RUNNING", tasks={"setup": ("TERMINATED", "SUCCESS"), "bronze": ("RUNNING", None)}),
        _run("TERMINATED", "SUCCESS", tasks={"setup": ("TERMINATED", "SUCCESS"), "bronze": ("TERMINATED", "SUCCESS")}),
    ]
    api = FakeApi([(12, f"[dev alice] {PIPELINE}")], [runs[0], *runs])
    lines: list[str] = []
    code = run_job("rulewatch_pipeline", {"landing": "/Volumes/a/b/c"}, log=lines.append, client=_client(api))
    assert code == 0
    assert api.run_now_bodies == [{"job_id": 12, "job_parameters": {"landing": "/Volumes/a/b/c"}}]
    assert lines[0].startswith(f"job [dev alice] {PIPELINE} (id 12): run 77 started https://")
    setup = [line for line in lines if line.strip().startswith("setup:")]
    assert setup == ["  setup: PENDING", "  setup: RUNNING", "  setup: TERMINATED SUCCESS"]
    assert lines[-1] == "run 77: TERMINATED SUCCESS"
    assert api.run_gets == 5  # one for the run's URL, then the waiter's polls until TERMINATED


def test_run_job_returns_one_when_the_run_fails_and_zero_without_follow(no_sleep):
    failed = _run("TERMINATED", "FAILED", tasks={"setup": ("TERMINATED", "FAILED")})
    lines: list[str] = []
    api = FakeApi([(12, PIPELINE)], [failed])
    assert run_job("12", None, log=lines.append, client=_client(api)) == 1
    assert "  setup: TERMINATED FAILED: boom" in lines
    assert api.run_now_bodies == [{"job_id": 12}]
    api = FakeApi([(12, PIPELINE)], [_run("PENDING")])
    assert run_job(PIPELINE, {}, follow=False, log=lambda _: None, client=_client(api)) == 0
    assert api.run_gets == 1  # triggered, not followed


def test_run_job_stops_following_at_the_timeout_and_on_an_internal_error(no_sleep):
    lines: list[str] = []
    api = FakeApi([(12, PIPELINE)], [_run("RUNNING")])
    assert run_job("12", None, log=lines.append, client=_client(api), timeout=timedelta(0)) == 1
    assert "run 77: still RUNNING after 0:00:00; it goes on in the workspace" in lines
    lines.clear()
    api = FakeApi([(12, PIPELINE)], [_run("RUNNING"), _run("INTERNAL_ERROR")])
    assert run_job("12", None, log=lines.append, client=_client(api)) == 1
    assert lines[-2] == "run 77: INTERNAL_ERROR"
    assert lines[-1].startswith("run 77: failed to reach TERMINATED or SKIPPED")  # the SDK's OperationFailed


# ---- SQL: identifiers validated, values as parameters -----------------------------------------------


@pytest.mark.parametrize("good", ["main", "rulewatch", "_x1", "Fraud_Prod", "a" * 255])
def test_plain_identifiers_pass(good):
    assert validate_identifier(good) == good


@pytest.mark.parametrize(
    "bad", ["main; DROP TABLE x", "main.rulewatch", "`main`", "ma in", "1main", "", "main--", "x/y", "main'", "a" * 256, "rüle"]
)
def test_anything_else_is_rejected(bad):
    with pytest.raises(ValueError, match="not a plain identifier"):
        validate_identifier(bad, "catalog")


def test_alerts_statement_keeps_the_limit_a_parameter():
    sql = alerts_statement("main", "rulewatch")
    assert "FROM `main`.`rulewatch`.`gold_alerts` " in sql  # the bundle's managed table
    assert "FROM delta.`/Volumes/main/rulewatch/lakehouse/gold/alerts` " in alerts_statement("main", "rulewatch", "lakehouse")
    assert sql.endswith("LIMIT :limit")
    with pytest.raises(ValueError):
        alerts_statement("main; DROP TABLE x", "rulewatch")
    with pytest.raises(ValueError):
        alerts_statement("main", "rulewatch", "lake/../house")


class FakeStatements:
    def __init__(self, responses: list[dict]):
        self.responses = [StatementResponse.from_dict(r) for r in responses]
        self.calls: list[dict] = []

    def execute_statement(self, **kwargs):
        self.calls.append(kwargs)
        return self.responses.pop(0)

    def get_statement(self, statement_id):
        return self.responses.pop(0)


def test_latest_alerts_sends_parameters_and_returns_rows(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda _: None)
    columns = [{"name": n} for n in ("rule_id", "group_key", "transaction_id")]
    statements = FakeStatements(
        [
            {"statement_id": "s1", "status": {"state": "RUNNING"}},
            {
                "statement_id": "s1",
                "status": {"state": "SUCCEEDED"},
                "manifest": {"schema": {"columns": columns}},
                "result": {"data_array": [["1", "p1|b1", "t9"], ["2", "u7", "t8"]]},
            },
        ]
    )
    rows = latest_alerts("wh1", "main", "rulewatch", 5, client=SimpleNamespace(statement_execution=statements))
    assert rows == [
        {"rule_id": "1", "group_key": "p1|b1", "transaction_id": "t9"},
        {"rule_id": "2", "group_key": "u7", "transaction_id": "t8"},
    ]
    (call,) = statements.calls
    assert call["warehouse_id"] == "wh1" and call["catalog"] == "main" and call["schema"] == "rulewatch"
    assert [p.as_dict() for p in call["parameters"]] == [{"name": "limit", "type": "INT", "value": "5"}]
    assert "5" not in call["statement"]


def test_latest_alerts_reports_a_failed_statement():
    statements = FakeStatements([{"statement_id": "s1", "status": {"state": "FAILED", "error": {"message": "PATH_NOT_FOUND"}}}])
    with pytest.raises(RemoteError, match="FAILED: PATH_NOT_FOUND"):
        latest_alerts("wh1", client=SimpleNamespace(statement_execution=statements))


def test_bad_input_is_rejected_before_any_call():
    untouchable = SimpleNamespace()  # any attribute access would raise AttributeError
    with pytest.raises(ValueError, match="catalog"):
        latest_alerts("wh1", "main; DROP TABLE x", "rulewatch", client=untouchable)
    with pytest.raises(ValueError, match="limit"):
        latest_alerts("wh1", "main", "rulewatch", 0, client=untouchable)
    with pytest.raises(ValueError, match="warehouse"):
        latest_alerts(" ", "main", "rulewatch", client=untouchable)


def test_alerts_command_rejects_a_bad_identifier_with_exit_2(no_databricks_config, capsys):
    args = _parser().parse_args(["remote", "alerts", "--warehouse-id", "w", "--catalog", "main; DROP TABLE x"])
    assert args.func(args) == 2
    assert "not a plain identifier" in capsys.readouterr().err


def test_defaults_match_the_prod_target():
    from rulewatch.bundle.config import Identity

    bundle = load_bundle(ROOT, {"service_principal": "sp"}, target="prod", identity=Identity.of("sp", service_principal=True), environ={})
    assert remote.DEFAULT_JOB in bundle.jobs
    assert (bundle.variables["catalog"], bundle.variables["schema"]) == (remote.DEFAULT_CATALOG, remote.DEFAULT_SCHEMA)
    assert bundle.variables["lakehouse"] == f"/Volumes/{remote.DEFAULT_CATALOG}/{remote.DEFAULT_SCHEMA}/{remote.DEFAULT_VOLUME}"
