"""Operational safety: one run per lakehouse; clear errors instead of corrupted checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FIXTURES, ROOT
from rulewatch.cli import jobs, kafka_cli
from rulewatch.cli.main import build_parser, main
from rulewatch.spark.storage.lakehouse import HOLDER_ENV, Lakehouse, LakehouseBusy, LakehouseUnwritable, exclusive
from rulewatch.spark.evaluator.settings import GoldSettings


def test_a_second_run_on_a_busy_lakehouse_fails_fast_with_a_clear_message(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    with exclusive(lakehouse):
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "rulewatch.cli.main", "run", "--lakehouse", lakehouse.root,
             "--landing", str(FIXTURES / "transactions"), "--rules", str(FIXTURES / "rules.json")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert time.monotonic() - started < 30  # before any Spark start-up
    assert result.returncode == 2
    assert f"lakehouse {lakehouse.root} is in use by pid" in result.stderr
    assert "wait for that run to finish" in result.stderr


def test_the_lock_is_released_after_a_run(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    with exclusive(lakehouse):
        with pytest.raises(LakehouseBusy):
            with exclusive(lakehouse):
                pass
    with exclusive(lakehouse):  # free again
        pass


@pytest.mark.parametrize(
    ("command", "when"),
    [
        ("rulewatch stream", "its gold stream applies this change from its next micro-batch"),
        ("rulewatch demo", "its gold stream applies this change from its next micro-batch"),
        ("rulewatch run", "that run's evaluator takes this change only if its gold layer had not started yet, otherwise the next run's "
                          "(the run's summary names the config/rules version it evaluated with)"),
        ("rulewatch job run rulewatch_live", "a live stream applies this change from its next micro-batch; a run whose gold layer has started, from the next run"),
    ],
)  # fmt: skip
def test_the_lock_names_its_command_and_rules_apply_says_when_the_holder_takes_a_change(tmp_path, command, when):
    from rulewatch.cli.rules_cli import running_notice
    from rulewatch.spark.storage.lakehouse import lock_holder

    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    assert lock_holder(lakehouse) is None  # no lock file yet
    with exclusive(lakehouse, command):
        notice = running_notice(lock_holder(lakehouse) or "")
    assert notice.startswith(f"rulewatch: lakehouse in use by pid {os.getpid()} ({command}) since ")
    assert notice.endswith(when) and "\n" not in notice
    assert lock_holder(lakehouse) is None  # released; the file stays


def test_rules_apply_prints_the_notice_only_while_a_run_holds_the_lakehouse(tmp_path, capsys, monkeypatch):
    from rulewatch.cli import rules_cli
    from rulewatch.spark.control import rules_table

    monkeypatch.setattr(rules_cli, "_spark_and_lakehouse", lambda args: (None, Lakehouse(args.lakehouse)))
    changes = {"updated": [rules_table.RuleChange(1, "updated")], "unchanged": [rules_table.RuleChange(1, "unchanged")]}
    outcome = "updated"
    monkeypatch.setattr(rules_table, "apply_rules", lambda *_: changes[outcome])
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    apply = ["rules", "apply", str(FIXTURES / "rules.json"), "--lakehouse", lakehouse.root]
    with exclusive(lakehouse, "rulewatch run"):
        code, err = cli(apply, capsys)
        assert code == 0 and f"rulewatch: lakehouse in use by pid {os.getpid()} (rulewatch run) since " in err
        outcome = "unchanged"  # nothing written: nothing for the run to take
        assert "in use" not in cli(apply, capsys)[1]
    outcome = "updated"
    assert "in use" not in cli(apply, capsys)[1]


def test_a_local_job_run_holds_the_same_lock(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the repository's bundle
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ran: list[str] = []
    given: dict[str, dict[str, str]] = {}

    def task_checking_the_lock(task, params, cwd):  # instead of a notebook
        with pytest.raises(LakehouseBusy):
            with exclusive(lakehouse):
                pass
        assert os.environ[HOLDER_ENV] == str(os.getpid())  # the kernels it starts write under its hold
        ran.append(task.key)
        given[task.key] = params
        return None, None

    monkeypatch.setattr(jobs, "_execute_notebook", task_checking_the_lock)
    landing, rules = tmp_path / "landing", tmp_path / "rules.json"
    job_run = ["job", "run", "--target", "local", "--lakehouse", lakehouse.root, "--landing", str(landing), "--rules", str(rules)]
    with exclusive(lakehouse):
        started = time.monotonic()
        assert main(job_run) == 2
        assert time.monotonic() - started < 10
    assert ran == []
    err = capsys.readouterr().err
    assert f"rulewatch: lakehouse {lakehouse.root} is in use by pid {os.getpid()}" in err and "Traceback" not in err

    assert main(job_run) == 0
    assert HOLDER_ENV not in os.environ
    assert ran == ["setup", "bronze", "silver", "gold"]
    # --landing and --rules reach the tasks that read them, not the bundle's defaults (the fixtures).
    assert (given["setup"]["rules_file"], given["bronze"]["landing"]) == (str(rules), str(landing))
    with exclusive(lakehouse):  # released when the job ends
        pass


# ------------------------------------------------------------- clear errors before anything starts


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``rulewatch ARGV``, whether the parser or the command ends it."""
    try:
        code = main(argv)
    except SystemExit as end:
        code = end.code
    return code, capsys.readouterr().err


def commands(lakehouse: str) -> dict[str, list[str]]:
    return {
        "run": ["run", "--lakehouse", lakehouse, "--landing", str(FIXTURES / "transactions")],
        "stream": ["stream", "--lakehouse", lakehouse],
        "demo": ["demo", "--lakehouse", lakehouse],
        "bench": ["bench"],
    }


BAD_SHARDS = {
    "0": "shards must be between 1 and 4096, got 0",
    "-1": "shards must be between 1 and 4096, got -1",
    "5000": "shards must be between 1 and 4096, got 5000",
    "abc": f"shards must be a whole number such as {GoldSettings.shards}, got 'abc'",
}
BAD_LATENESS = {value: f"bad duration {value!r}; expected a positive integer followed by ms, s, m, h or d" for value in ("soon", "-1h", "")}


@pytest.mark.parametrize("command", ["run", "stream", "demo", "bench"])
@pytest.mark.parametrize(("value", "message"), BAD_SHARDS.items(), ids=BAD_SHARDS.keys())
def test_bad_shards_are_reported_by_the_parser(tmp_path, capsys, command, value, message):
    code, err = cli([*commands(str(tmp_path / "lakehouse"))[command], f"--shards={value}"], capsys)
    assert code == 2
    assert f"error: argument --shards: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "lakehouse").exists()


@pytest.mark.parametrize("command", ["run", "stream", "demo"])
@pytest.mark.parametrize(("value", "message"), BAD_LATENESS.items(), ids=["soon", "-1h", "empty"])
def test_a_bad_allowed_lateness_is_reported_by_the_parser(tmp_path, capsys, command, value, message):
    code, err = cli([*commands(str(tmp_path / "lakehouse"))[command], f"--allowed-lateness={value}"], capsys)
    assert code == 2
    assert f"error: argument --allowed-lateness: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "lakehouse").exists()


BAD_VALUES = [
    *[(["stream", "--lakehouse", "L", "--trigger", bad], "--trigger", "expected a whole number and a unit (milliseconds, seconds, minutes or hours) "
       f"such as '0 seconds' or '500 milliseconds', got {bad!r}") for bad in ("fast", "-1 seconds", "5")],
    (["stream", "--lakehouse", "L", "--shuffle-partitions", "0"], "--shuffle-partitions", "shuffle partitions must be at least 1, got 0"),
    (["stream", "--lakehouse", "L", "--duration", "-5"], "--duration", "must be above 0 seconds, got -5.0"),
    *[(["demo", "--lakehouse", "L", "--metrics-every", bad], "--metrics-every", f"metrics every must be 0 seconds or more, got {bad!r}")
      for bad in ("-1", "nan", "inf")],
    (["stream", "--lakehouse", "L", "--metrics-every", "soon"], "--metrics-every", "metrics every must be a number such as 30, got 'soon'"),
    (["generate", "--landing", "x", "--rate", "0"], "--rate", "must be above 0 events/s, got 0.0"),
    (["generate", "--landing", "x", "--rate", "lots"], "--rate", "rate must be a number such as 1000, got 'lots'"),
    (["generate", "--landing", "x", "--duration", "0"], "--duration", "must be above 0 seconds, got 0.0"),
    (["generate", "--landing", "x", "--file-interval", "0"], "--file-interval", "must be between 0.01 and 60 seconds, got 0.0"),
    (["generate", "--landing", "x", "--pattern-every", "-1"], "--pattern-every", "must be 0 (no patterns) or more seconds, got -1.0"),
    (["demo", "--lakehouse", "L", "--minutes", "0"], "--minutes", "must be above 0 minutes, got 0"),
    (["demo", "--lakehouse", "L", "--rate", "-1"], "--rate", "must be above 0 events/s, got -1.0"),
    (["rules", "history", "--lakehouse", "L", "--last", "0"], "--last", "changes must be at least 1, got 0"),
    (["rules", "history", "--lakehouse", "L", "--last", "x"], "--last", "changes must be a whole number such as 20, got 'x'"),
    (["rules", "clear-state", "--lakehouse", "L", "--rule", "0"], "--rule", "a rule id must be between 1 and 2147483647, got 0"),
    (["rules", "clear-state", "--lakehouse", "L", "--rule", "one"], "--rule", "a rule id must be a whole number such as 1, got 'one'"),
    (["bench", "--events", "0"], "--events", "events must be at least 1, got 0"),
    (["bench", "--keys", "-3"], "--keys", "keys must be at least 1, got -3"),
    (["bench", "--batch-events", "1e5"], "--batch-events", "batch events must be a whole number such as 50000, got '1e5'"),
    (["bench", "--state-slots", "0", "-1"], "--state-slots", "state_slots must be between 0 and 1,000,000, got -1"),
    (["bench", "--scale-curve", "0"], "--scale-curve", "events per key must be at least 1, got 0"),
    (["bench", "--rule-propagation", "0"], "--rule-propagation", "trials must be at least 1, got 0"),
    (["run", "--lakehouse", "L", "--kafka-topic", "p", "--kafka-bootstrap", "h:1", "--kafka-max-offsets", "0"], "--kafka-max-offsets", "max offsets must be at least 1, got 0"),
    (["kafka", "start", "--dir", "D", "--port", "70000"], "--port", "port must be between 1 and 65535, got 70000"),
]


@pytest.mark.parametrize(("argv", "flag", "message"), BAD_VALUES, ids=[f"{a[0]}{f}={a[-1]}" for a, f, _ in BAD_VALUES])
def test_bad_values_end_in_one_line_from_the_parser(tmp_path, capsys, monkeypatch, argv, flag, message):
    monkeypatch.chdir(tmp_path)  # a command that got past the parser would write here
    code, err = cli(argv, capsys)
    assert code == 2
    prog = "rulewatch " + " ".join(argv[:2] if argv[0] in ("rules", "kafka") else argv[:1])
    assert err == f"{prog}: error: argument {flag}: {message} (see {prog} --help)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "--lakehose", "L", "--landing", "in"], "unknown flag --lakehose (did you mean --lakehouse?)"),
        (["rules", "apply", "f.json", "--lakehouse", "L", "--updated-bye", "me"], "unknown flag --updated-bye (did you mean --updated-by?)"),
        (["stream", "--lakehouse", "L", "--no-such-thing=1"], "unknown flag --no-such-thing"),
    ],
    ids=["hides a required flag", "a subcommand's flag", "no close flag"],
)
def test_a_mistyped_flag_is_named_before_anything_else(capsys, argv, said):
    code, err = cli(argv, capsys)
    prog = "rulewatch " + " ".join(argv[:2] if argv[0] == "rules" else argv[:1])
    assert (code, err) == (2, f"{prog}: error: {said} (see {prog} --help)\n")


def test_flags_still_work_abbreviated_and_values_that_look_like_flags_are_values(capsys):
    parse = build_parser().parse_args
    assert parse(["run", "--lake", "L", "--landing", "in"]).lakehouse == "L"
    assert parse(["rules", "apply", "--lakehouse", "L", "--", "--odd-name.json"]).file == "--odd-name.json"
    assert parse(["sql", "--lakehouse", "L", "-e", "-- a comment\nSELECT 1"]).execute == ["-- a comment\nSELECT 1"]
    code, err = cli(["run", "--kafka", "t", "--lakehouse", "L", "--landing", "in"], capsys)  # ambiguous: argparse says so
    assert code == 2 and "ambiguous option: --kafka could match" in err


def test_generate_offers_the_kafka_flags_of_a_sender(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--kafka-topic KAFKA_TOPIC send the transactions to this topic" in shown
    assert "--kafka-starting-offsets" not in shown and "--kafka-max-offsets" not in shown and "read transactions" not in shown
    args = build_parser().parse_args(["generate", "--kafka-bootstrap", "127.0.0.1:9", "--kafka-topic", "t"])
    assert kafka_cli.source(args).topic.topic == "t"


def test_transactions_is_still_accepted_as_the_landing_folder(capsys):
    assert build_parser().parse_args(["run", "--lakehouse", "L", "--transactions", "in"]).landing == "in"
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = capsys.readouterr().out
    assert "--landing" in shown and "--transactions" not in shown


def test_metrics_every_and_the_layout_reach_the_live_settings(tmp_path):
    from rulewatch.cli.live_cli import _settings

    new = Lakehouse(str(tmp_path))  # no gold checkpoint: GoldSettings' defaults, as for every command
    for command in ("stream", "demo"):
        settings = _settings(build_parser().parse_args([command, "--lakehouse", new.root]), new)
        assert (settings.metrics_every, settings.gold.layout) == (30, {"shards": 4, "state_slots": 0})
        asked = build_parser().parse_args([command, "--lakehouse", new.root, "--metrics-every", "0", "--shards", "8"])
        assert (_settings(asked, new).metrics_every, _settings(asked, new).gold.shards) == (0, 8)


@pytest.fixture
def no_notebooks(monkeypatch):
    """A job run that got past its checks would run the real notebooks: fail the test instead."""
    monkeypatch.setattr(jobs, "_execute_notebook", lambda *_: pytest.fail("a task ran"))
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("command", ["run", "stream", "demo", "job run"])
def test_a_lakehouse_that_is_a_file_is_named_with_the_fix(tmp_path, capsys, no_notebooks, command):
    path = tmp_path / "lakehouse"
    path.write_text("not a folder")
    argv = ["job", "run", "--lakehouse", str(path)] if command == "job run" else commands(str(path))[command]
    code, err = cli(argv, capsys)
    assert code == 2
    assert err == f"rulewatch: lakehouse {path} is a file, not a folder; pass --lakehouse a folder (it is created if missing)\n"


def test_a_lakehouse_below_a_file_is_named_with_the_fix(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "lakehouse"
    code, err = cli(commands(str(path))["run"], capsys)
    assert code == 2
    assert err == (
        f"rulewatch: lakehouse {path} cannot be written (Not a directory: {path}); "
        "pass --lakehouse a folder on a writable file system that this user may write to\n"
    )


def test_debug_shows_the_traceback_instead(tmp_path):
    path = tmp_path / "lakehouse"
    path.write_text("not a folder")
    with pytest.raises(LakehouseUnwritable, match="is a file, not a folder") as caught:
        main(["--debug", *commands(str(path))["run"]])
    assert isinstance(caught.value.__cause__, FileExistsError)


NO_READ_ONLY_MOUNT = 97


def test_a_read_only_lakehouse_is_named_with_the_fix(tmp_path):
    """A real read-only file system (root writes through permission bits): a read-only bind mount of
    the lakehouse folder in a private mount namespace, which only the command inside it sees."""
    lakehouse = tmp_path / "lakehouse"
    lakehouse.mkdir()
    script = (
        f'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" || exit {NO_READ_ONLY_MOUNT}; '
        'exec "$2" -m rulewatch.cli.main run --lakehouse "$1" --landing "$3"'
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(lakehouse), sys.executable, str(FIXTURES / "transactions")]
    try:
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if result.returncode == NO_READ_ONLY_MOUNT or "unshare: " in result.stderr:
        pytest.skip(f"cannot make a read-only bind mount here (needs root): {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"rulewatch: lakehouse {lakehouse} cannot be written (Read-only file system: {lakehouse}/_lock); "
        "pass --lakehouse a folder on a writable file system that this user may write to\n"
    )
    assert list(lakehouse.iterdir()) == []


def test_transactions_that_are_a_file_are_refused_before_spark(tmp_path, capsys):
    landing = tmp_path / "transactions.jsonl"
    landing.write_text("")
    code, err = cli(["run", "--lakehouse", str(tmp_path / "lakehouse"), "--landing", str(landing)], capsys)
    assert code == 2
    assert err == f"rulewatch: --landing {landing} is a file, not a folder; point it at the folder that holds it\n"
    assert not (tmp_path / "lakehouse").exists()


@pytest.mark.parametrize("content", [None, '[{"ruleId": 1, "groupingKeyNames": ["payeeId"]}]'], ids=["missing", "invalid"])
def test_a_bad_rules_file_is_refused_before_spark(tmp_path, capsys, content):
    rules = tmp_path / "rules.json"
    if content is not None:
        rules.write_text(content)
    landing = tmp_path / "landing"
    landing.mkdir()
    args = ["run", "--lakehouse", str(tmp_path / "lakehouse"), "--landing", str(landing), "--rules", str(rules)]
    code, err = cli(args, capsys)
    assert code == 2
    assert err.startswith("rulewatch: ") and str(rules) in err
    assert ("cannot be read" in err) if content is None else ("aggregateFieldName" in err)
    assert not (tmp_path / "lakehouse").exists()  # refused before the lakehouse (and Spark) was touched


@pytest.mark.parametrize("command", ["rules apply", "run --rules"])
def test_a_rules_file_that_is_a_fifo_is_refused_at_once(tmp_path, capsys, monkeypatch, command):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    fifo = tmp_path / "rules.json"
    os.mkfifo(fifo)
    args = {
        "rules apply": ["rules", "apply", str(fifo)],
        "run --rules": ["run", "--landing", str(tmp_path), "--rules", str(fifo)],
    }[command] + ["--lakehouse", str(tmp_path / "lakehouse")]

    def blocked(*_):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # end the blocked read, or pytest waits too
        raise AssertionError(f"rulewatch {command} still reading the FIFO after 5 s")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(5)
    try:
        code, err = cli(args, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 2
    assert err.startswith(f"rulewatch: 1 invalid rule(s) in {fifo}:\n  is a named pipe (FIFO), not a regular file; give the path of a rules file\n")
    assert "Traceback" not in err and not (tmp_path / "lakehouse").exists()


@pytest.mark.parametrize("command", ["stream", "demo"])
def test_stream_and_demo_list_every_rules_problem_before_spark(tmp_path, capsys, monkeypatch, command):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    bad, missing = tmp_path / "bad.json", tmp_path / "missing.json"
    rule = {"ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeId"], "aggregateFieldName": "paymentAmount",
            "aggregatorFunctionType": "SUMM", "limitOperatorType": "GREATER", "limit": 5, "windowMinutes": 5}  # fmt: skip
    bad.write_text(json.dumps([rule, {"ruleId": 2, "ruleState": "ON"}]))
    code, err = cli([command, "--lakehouse", str(tmp_path / "lh"), "--rules", str(bad), "--rules", str(missing)], capsys)
    assert code == 2
    assert f"rulewatch: 2 invalid rule(s) in {bad}, 9 problems:" in err
    assert "did you mean 'payeeId'?" in err and "did you mean 'SUM'?" in err and "field 'ruleState' has 'ON'" in err
    assert f"rulewatch: 1 invalid rule(s) in {missing}:\n  cannot be read: No such file or directory" in err
    assert err.endswith("rulewatch: nothing was started or written\n") and "Traceback" not in err
    assert not (tmp_path / "lh").exists()


@pytest.mark.parametrize("command", ["stream", "demo"])
def test_gold_from_the_source_needs_a_kafka_source(tmp_path, capsys, monkeypatch, command):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    code, err = cli([command, "--lakehouse", str(tmp_path / "lh"), "--gold-source", "topic"], capsys)
    assert code == 2 and "--gold-source topic reads a Kafka topic: give --kafka-bootstrap and --kafka-topic too" in err
    assert "Traceback" not in err and not (tmp_path / "lh").exists()


def test_a_run_without_an_active_rule_warns_first():
    from rulewatch.spark.layers.pipeline import NO_RULES_WARNING, Summary

    quiet = Summary(bronze=3, silver=3, quarantined=0, duplicates=0, alerts=0, late=0, active_rules=0)
    assert quiet.lines()[0] == NO_RULES_WARNING and "active rules     0" in quiet.lines()
    ruled = Summary(bronze=3, silver=3, quarantined=0, duplicates=0, alerts=0, late=0, active_rules=2)
    assert NO_RULES_WARNING not in ruled.lines() and "active rules     2" in ruled.lines()


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"rulewatch {version('rulewatch')}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--lakehouse", "L"], "either as --landing FOLDER or as --kafka-topic TOPIC"),
        (["run", "--lakehouse", "L", "--landing", "fixtures/transactions", "--kafka-topic", "t", "--kafka-bootstrap", "h:1"], "either as --landing"),
        (["run", "--lakehouse", "L", "--kafka-topic", "payments"], "--kafka-topic payments needs Kafka bootstrap servers"),
        (["run", "--lakehouse", "L", "--kafka-topic", "pay ments", "--kafka-bootstrap", "h:1"], "not a valid topic name"),
        (["run", "--lakehouse", "L", "--kafka-topic", "p", "--kafka-bootstrap", "nohost"], "is not host:port"),
        (["run", "--lakehouse", "L", "--landing", "fixtures/transactions", "--alerts-topic", "a"], "--alerts-topic a needs Kafka bootstrap"),
        (["stream", "--lakehouse", "L", "--landing", "x", "--kafka-topic", "p", "--kafka-bootstrap", "h:1"], "not both"),
        (["generate", "--duration", "1"], "--landing FOLDER or --kafka-topic TOPIC"),
    ],
)
def test_bad_kafka_options_are_one_line_before_spark(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("rulewatch: ") and len(err.strip().splitlines()) == 1


def test_bench_pipeline_refuses_two_state_layouts_before_starting_spark(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli(["bench", "--pipeline", "--state-slots", "0", "16"], capsys)
    assert (code, err) == (2, "rulewatch: bench --pipeline runs the job with one state layout; give one --state-slots value\n")
    assert list(tmp_path.iterdir()) == []


def test_bench_rounds_without_the_pipeline_is_refused_before_starting_spark(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli(["bench", "--rounds", "2"], capsys)
    assert (code, err) == (2, "rulewatch: bench --rounds repeats the whole job: give --pipeline with it\n")
    assert list(tmp_path.iterdir()) == []


# A process that holds a lakehouse until its stdin closes, saying so first.
_HOLDER = (
    "import sys\nfrom rulewatch.spark.storage.lakehouse import Lakehouse, exclusive\n"
    "with exclusive(Lakehouse(sys.argv[1]), 'rulewatch run'):\n    print('held', flush=True)\n    sys.stdin.read()\n"
)
# A layer's run in a process of its own: whether it may write the lakehouse.
_LAYER = (
    "import sys\nfrom rulewatch.spark.storage.lakehouse import Lakehouse, held_here, holding\n"
    "with holding(Lakehouse(sys.argv[1]), 'bronze run'):\n    print('ran', held_here(sys.argv[1] + '/gold/alerts'))\n"
)


@pytest.mark.subprocess
def test_a_notebooks_layer_run_and_a_command_never_write_one_lakehouse_at_once(tmp_path):
    from rulewatch.spark.layers.pipeline import run_bronze, run_gold
    from rulewatch.spark.live.streams import stream
    from rulewatch.spark.storage.lakehouse import HOLDER_ENV

    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    env = {k: v for k, v in os.environ.items() if k != HOLDER_ENV}
    with subprocess.Popen([sys.executable, "-c", _HOLDER, lakehouse.root], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline() == "held\n"
        # Refused before anything is read or written (no session needed to get that far).
        for layer_run in (lambda: run_bronze(None, lakehouse, str(tmp_path)), lambda: run_gold(None, lakehouse), lambda: stream(None, lakehouse, str(tmp_path))):
            with pytest.raises(LakehouseBusy, match=f"in use by pid {holder.pid} \\(rulewatch run\\)"):
                layer_run()
        holder.stdin.close()
    # A command started while a notebook's layer runs is refused the same way.
    with exclusive(lakehouse, "bronze run"):
        result = subprocess.run([sys.executable, "-c", _LAYER, lakehouse.root], env=env, capture_output=True, text=True)
        assert result.returncode == 1 and f"is in use by pid {os.getpid()} (bronze run)" in result.stderr
        # A task of the `rulewatch job run` holding it runs under its hold, as the only writer; a holder named
        # wrongly gives no pass.
        result = subprocess.run([sys.executable, "-c", _LAYER, lakehouse.root], env={**env, HOLDER_ENV: str(os.getpid())}, capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (0, "ran True\n"), result.stderr
        result = subprocess.run([sys.executable, "-c", _LAYER, lakehouse.root], env={**env, HOLDER_ENV: "1"}, capture_output=True, text=True)
        assert result.returncode == 1 and "LakehouseBusy" in result.stderr
