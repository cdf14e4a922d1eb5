"""The bundle job's DAG run locally: real notebook executions, the same alerts as the CLI path."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import yaml
from chispa import assert_df_equality

from conftest import FIXTURES, ROOT
from rulewatch.cli.main import main
from rulewatch.cli import jobs
from rulewatch.cli.jobs import JobError, JobRunFailed, load_bundle, run_job_locally, task_order, task_parameters
from rulewatch.spark.storage.checkpoints import GOLD_LAYOUT
from rulewatch.spark.storage.lakehouse import Lakehouse, exclusive


@pytest.mark.jvm
@pytest.mark.notebook
@pytest.mark.slow
def test_bundle_job_runs_locally_and_matches_the_cli(spark, fixture_run, tmp_path, job_kernel):
    lakehouse = tmp_path / "lakehouse"
    lines: list[str] = []
    # Under the hold `rulewatch job run` takes: the notebooks' layers write as the holder's tasks.
    with exclusive(Lakehouse(str(lakehouse)), "rulewatch job run"), jobs._named_holder():
        results = run_job_locally(
            None,
            # Another state layout than the CLI run's (8 slots, not 0): the job parameters reach gold, and the alerts do not change.
            {"lakehouse": str(lakehouse), "landing": str(FIXTURES / "transactions"), "rules_file": str(FIXTURES / "rules.json"),
             "shards": "4", "state_slots": "8"},
            log=lines.append,
            root=ROOT,
        )  # fmt: skip
    assert [(r.task_key, r.status) for r in results] == [("setup", "ok"), ("bronze", "ok"), ("silver", "ok"), ("gold", "ok")]
    assert json.loads((lakehouse / "_checkpoints" / "gold" / GOLD_LAYOUT).read_text()) == {"shards": 4, "state_slots": 8, "shard_partitions": 4, "source": "silver"}
    assert [re.sub(r"\(\d+\.\d+s\)", "(Ns)", line) for line in lines[1:]] == [
        "[1/4] setup ... ok (Ns)",
        "[2/4] bronze ... ok (Ns)",
        "[3/4] silver ... ok (Ns)",
        "[4/4] gold ... ok (Ns)",
    ]
    gold_text = "".join(out.get("text", "") for cell in results[-1].notebook.cells if cell.cell_type == "code" for out in cell.outputs)
    assert "bronze = silver + quarantined + duplicates: ok" in gold_text

    columns = ["rule_id", "rule_version", "group_key", "transaction_id", "event_time", "aggregate_value", "event_count"]
    assert_df_equality(
        spark.read.format("delta").load(str(lakehouse / "gold" / "alerts")).select(*columns),
        spark.read.format("delta").load(f"{fixture_run.lakehouse.root}/gold/alerts").select(*columns),
        ignore_row_order=True,
    )


@pytest.mark.jvm
@pytest.mark.notebook
@pytest.mark.slow
def test_the_live_job_runs_locally_and_raises_the_same_alerts(spark, fixture_run, tmp_path, job_kernel):
    # The streams stop once everything landed has gone through (drain), within the duration.
    lakehouse, landing = tmp_path / "lakehouse", tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    results = run_job_locally(
        "rulewatch_live",
        # Not the live defaults (4, 0): the job parameters reach the evaluator.
        {"lakehouse": str(lakehouse), "landing": str(landing), "rules_file": str(FIXTURES / "rules.json"), "duration": "300", "drain": "true",
         "shards": "2", "state_slots": "4"},
        log=lambda _: None,
        root=ROOT,
    )  # fmt: skip
    assert [(r.task_key, r.status) for r in results] == [("live", "ok")]
    assert json.loads((lakehouse / "_checkpoints" / "gold" / GOLD_LAYOUT).read_text()) == {"shards": 2, "state_slots": 4, "shard_partitions": 4, "source": "silver"}
    columns = ["rule_id", "rule_version", "group_key", "transaction_id", "event_time", "aggregate_value", "event_count"]
    assert_df_equality(
        spark.read.format("delta").load(str(lakehouse / "gold" / "alerts")).select(*columns),
        spark.read.format("delta").load(f"{fixture_run.lakehouse.root}/gold/alerts").select(*columns),
        ignore_row_order=True,
    )


# ---- a tiny bundle of kernels that start in a second, for failure handling and the CLI -------------


def _notebook(path: Path, source: str) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)


def write_bundle(root: Path, jobs: dict, variables: dict | None = None) -> Path:
    """``databricks.yml`` + ``resources/jobs.yml`` under ``root``; notebooks go in ``root/notebooks``."""
    (root / "resources").mkdir(parents=True, exist_ok=True)
    (root / "notebooks").mkdir(exist_ok=True)
    document = {"bundle": {"name": "tiny"}, "include": ["resources/*.yml"], "variables": variables or {}}
    (root / "databricks.yml").write_text(yaml.safe_dump(document))
    (root / "resources" / "jobs.yml").write_text(yaml.safe_dump({"resources": {"jobs": jobs}}))
    return root


RECORD = """\
import json, os
from pathlib import Path
from rulewatch.spark.present.widgets import widget
out = Path(widget("lakehouse"))
out.mkdir(parents=True, exist_ok=True)
(out / "{name}.json").write_text(json.dumps({{"greeting": widget("greeting"), "cwd": os.getcwd()}}))
"""


def _task(key: str, notebook: str, *after: str) -> dict:
    task = {
        "task_key": key,
        "notebook_task": {
            "notebook_path": f"../notebooks/{notebook}.ipynb",
            "base_parameters": {"lakehouse": "{{job.parameters.lakehouse}}", "greeting": "{{job.parameters.greeting}}"},
        },
    }
    if after:
        task["depends_on"] = [{"task_key": a} for a in after]
    return task


@pytest.fixture
def failing_bundle(tmp_path) -> Path:
    """first -> boom -> after_boom -> last, and first -> sibling; boom raises."""
    root = write_bundle(
        tmp_path / "bundle",
        {
            "tiny": {
                "max_concurrent_runs": 1,
                "parameters": [{"name": "lakehouse", "default": ""}, {"name": "greeting", "default": "${var.greeting}"}],
                "tasks": [
                    _task("first", "record_first"),
                    _task("boom", "boom", "first"),
                    _task("after_boom", "record_after", "boom"),
                    _task("last", "record_last", "after_boom"),
                    _task("sibling", "record_sibling", "first"),
                ],
            }
        },
        variables={"greeting": {"default": "hello"}},
    )
    for name in ["first", "after", "last", "sibling"]:
        _notebook(root / "notebooks" / f"record_{name}.ipynb", RECORD.format(name=name))
    _notebook(root / "notebooks" / "boom.ipynb", 'from rulewatch.spark.present.widgets import widget\nraise ValueError(f"boom at {widget(\'greeting\')}")')
    return root


@pytest.mark.notebook
def test_a_failing_task_skips_its_dependants_and_names_the_task(failing_bundle, tmp_path, capfd):
    out = tmp_path / "out"
    lines: list[str] = []
    with pytest.raises(JobRunFailed) as failure:
        run_job_locally(None, {"lakehouse": str(out)}, log=lines.append, root=failing_bundle, variables={"greeting": "hi"})
    # The job run started its kernel, which talks over private Unix sockets: ipykernel's warning about
    # unencrypted TCP is not printed.
    assert "without encryption" not in capfd.readouterr().err

    assert "task boom failed: ValueError: boom at hi" in str(failure.value)
    assert [(r.task_key, r.status) for r in failure.value.results] == [
        ("first", "ok"),
        ("boom", "failed"),
        ("after_boom", "skipped"),
        ("last", "skipped"),
        ("sibling", "ok"),  # independent of the failure, so it still runs
    ]
    assert re.fullmatch(r"\[2/5\] boom \.\.\. FAILED \(\d+\.\ds\): ValueError: boom at hi", lines[2])
    assert lines[3] == "[3/5] after_boom ... skipped (upstream boom did not succeed)"
    assert lines[4] == "[4/5] last ... skipped (upstream after_boom did not succeed)"
    # The kernels ran in the bundle root with the job's parameters, the variable override included.
    assert sorted(p.name for p in out.iterdir()) == ["first.json", "sibling.json"]
    assert json.loads((out / "first.json").read_text()) == {"greeting": "hi", "cwd": str(failing_bundle.resolve())}


def _cli(argv: list[str]) -> int:
    return main(argv)


@pytest.mark.notebook
def test_cli_exits_non_zero_naming_the_failed_task(failing_bundle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(failing_bundle / "notebooks")  # the bundle is found upwards from here
    assert _cli(["job", "run", "--target", "local", "--lakehouse", str(tmp_path / "out")]) == 1
    assert "task boom failed: ValueError: boom at hello; skipped: after_boom, last" in capsys.readouterr().err


def test_cli_points_remote_targets_at_the_databricks_cli(capsys):
    assert _cli(["job", "run", "rulewatch_pipeline", "--target", "dev", "--lakehouse", "x"]) == 2
    assert "databricks bundle run -t dev rulewatch_pipeline" in capsys.readouterr().err


def test_the_repo_bundle_resolves_variables_and_parameters():
    bundle = load_bundle(ROOT, {"landing": "/data/in"}, environ={})
    job = bundle.job(None)
    params = {t.key: task_parameters(job, t, {"lakehouse": "/lh"}) for t in task_order(job)}
    assert params["bronze"]["landing"] == "/data/in"  # ${var.landing} -> job parameter -> widget
    # A local run has no Unity Catalog: catalog and schema are empty (LOCAL_VARIABLES), so setup makes no
    # views, and tables too, so every table is a Delta folder under the lakehouse. Its shards are the CLI's
    # default for a new checkpoint, not the bundle's 16 for a cluster.
    assert params["setup"] == {
        "lakehouse": "/lh", "tables": "", "landing": "/data/in", "rules_file": "",
        "catalog": "", "schema": "", "pii_viewer_group": "fraud-investigators",
        "kafka_bootstrap": "", "kafka_topic": "", "kafka_starting_offsets": "earliest", "kafka_max_offsets": "",
        "alerts_topic": "", "kafka_secret_scope": "", "shards": "4", "state_slots": "0", "window_metrics": "near",
    }  # fmt: skip
    assert (params["gold"]["shards"], params["gold"]["state_slots"], params["gold"]["window_metrics"]) == ("4", "0", "near")
    # --var wins over the local stand-ins, as it wins over a target's values with the CLI.
    assert load_bundle(ROOT, {"catalog": "main"}, environ={}).variables["catalog"] == "main"


def _job(tasks: list[dict], **extra) -> dict:
    return {"tiny": {"max_concurrent_runs": 1, "parameters": [{"name": "lakehouse", "default": "x"}], "tasks": tasks, **extra}}


@pytest.mark.parametrize(
    ("jobs", "variables", "message"),
    [
        (_job([_task("a", "n", "b"), _task("b", "n", "a")]), {}, "dependency cycle among tasks a, b"),
        (_job([_task("a", "n", "ghost")]), {}, "task a depends on unknown task ghost"),
        (_job([_task("a", "n")]), {}, "unknown job parameter greeting"),
        (
            _job([{"task_key": "a", "notebook_task": {"notebook_path": "${var.nope}"}}]),
            {},
            "unknown variable ${var.nope}",
        ),
        (_job([{"task_key": "a", "spark_python_task": {"python_file": "x.py"}}]), {}, "only notebook_task runs locally"),
        ({**_job([]), "other": _job([])["tiny"]}, {}, "defines 2 jobs; name one of: other, tiny"),
    ],
)
def test_bad_bundles_fail_before_any_task_runs_and_say_where(tmp_path, jobs, variables, message):
    root = write_bundle(tmp_path, jobs, variables)
    with pytest.raises(JobError) as err:
        run_job_locally(None, {}, log=lambda _: None, root=root)
    assert message in str(err.value)
    assert str(root / "resources" / "jobs.yml") in str(err.value) or "defines 2 jobs" in message


def test_unknown_overrides_are_rejected(tmp_path):
    root = write_bundle(tmp_path, _job([]))
    with pytest.raises(JobError, match="no parameter landng"):
        run_job_locally(None, {"landng": "x"}, log=lambda _: None, root=root)
    with pytest.raises(JobError, match="no variable named nope"):
        run_job_locally(None, {}, log=lambda _: None, root=root, variables={"nope": "1"})


# A task that writes its lakehouse as the gold notebook does (under `holding`, which the kernel's inherited
# holder lets through) and ends with the summary's warning, as gold's does when no rule is active
# (test_notebooks.py: the real gold notebook's warning, found by the same notebook_warnings).
WARNING_TASK = """\
from rulewatch.spark.layers.pipeline import NO_RULES_WARNING
from rulewatch.spark.present.widgets import widget
from rulewatch.spark.storage.lakehouse import Lakehouse, holding
with holding(Lakehouse(widget("lakehouse")), "gold run"):
    print(NO_RULES_WARNING)
"""


@pytest.mark.notebook
def test_a_job_run_whose_task_warns_ends_with_the_warning(tmp_path, capsys, monkeypatch):
    """Every task succeeds, yet nothing could alert: the job's output must say so, last. The kernel is
    started inside the command's hold on the lakehouse, so its task may write there."""
    from rulewatch.spark.layers.pipeline import NO_RULES_WARNING

    parameters = [{"name": "lakehouse", "default": ""}, {"name": "greeting", "default": ""}]
    root = write_bundle(tmp_path / "bundle", _job([_task("first", "first"), _task("gold", "gold", "first")], parameters=parameters))
    _notebook(root / "notebooks" / "first.ipynb", "print('first')")
    _notebook(root / "notebooks" / "gold.ipynb", WARNING_TASK)
    monkeypatch.chdir(root)
    assert main(["job", "run", "--lakehouse", str(tmp_path / "lh")]) == 0
    captured = capsys.readouterr()
    out = [re.sub(r"\(\d+\.\d+s\)", "(Ns)", line) for line in captured.out.splitlines()]
    assert out[-2:] == ["[2/2] gold ... ok (Ns)", f"    {NO_RULES_WARNING}"]
    assert captured.err.splitlines()[-1] == f"rulewatch: task gold: {NO_RULES_WARNING}"
