"""The asset bundle checked offline: what ``databricks bundle validate`` and a first job run would catch.

Each check reads the same files the deploy ships (``databricks.yml`` and its ``include``s), so a
typo in a key, a renamed notebook or widget, or a broken task graph fails here, not on a cluster.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest
import yaml
from databricks.bundles.jobs import Job

from conftest import ROOT
from rulewatch.bundle.check import (
    DASHBOARD_DATASET_DEFAULTS_CLI,
    check_bundle,
    cli_version_floor,
    isolation_problems,
    load_schema,
    schema_problems,
)
from rulewatch.bundle.config import BundleError, Identity, load_config, target_names
from rulewatch.cli.jobs import JobError, JobSpec, load_bundle, task_order
from rulewatch.spark.storage.lakehouse import Lakehouse

BUNDLE = load_bundle(ROOT)
JOBS = sorted(BUNDLE.jobs)
TASKS = [(job.key, task.key) for job in BUNDLE.jobs.values() for task in job.tasks]


def _task(job_key: str, task_key: str):
    return next(t for t in BUNDLE.jobs[job_key].tasks if t.key == task_key)


def test_bundle_defines_the_pipeline_job():
    assert "rulewatch_pipeline" in BUNDLE.jobs
    assert [t.key for t in task_order(BUNDLE.jobs["rulewatch_pipeline"])] == ["setup", "bronze", "silver", "gold"]


def test_every_resource_file_is_included():
    # A YAML file under resources/ that no include glob matches would silently never deploy.
    on_disk = {p.resolve() for p in (ROOT / "resources").rglob("*") if p.suffix in {".yml", ".yaml"}}
    assert on_disk, "no resource files under resources/"
    assert on_disk <= set(BUNDLE.files), f"not matched by databricks.yml include: {sorted(on_disk - set(BUNDLE.files))}"


@pytest.mark.parametrize("job_key", JOBS)
def test_job_loads_with_the_typed_classes_and_no_unknown_keys(job_key):
    definition = BUNDLE.jobs[job_key].definition
    # from_dict raises "Unexpected field" on unknown keys; the round trip also catches any key
    # dropped or value coerced on the way (e.g. a string where a number belongs).
    job = Job.from_dict(copy.deepcopy(definition))
    assert job.as_dict() == definition


def test_typed_loading_rejects_a_misspelt_key():
    # Guards the check above: if a databricks-bundles upgrade stopped rejecting unknown keys, the
    # round-trip comparison must still notice.
    job_key = JOBS[0]
    definition = copy.deepcopy(BUNDLE.jobs[job_key].definition)
    definition["tasks"][0]["notebook_task"]["base_paramters"] = {"x": "1"}
    try:
        assert Job.from_dict(copy.deepcopy(definition)).as_dict() != definition
    except ValueError as err:
        assert "base_paramters" in str(err)


@pytest.mark.parametrize("job_key", JOBS)
def test_job_runs_one_at_a_time(job_key):
    # Two concurrent runs would race on the same checkpoints and Delta tables.
    assert BUNDLE.jobs[job_key].definition.get("max_concurrent_runs") == 1


@pytest.mark.parametrize("job_key", JOBS)
def test_task_graph_is_a_dag_of_known_tasks(job_key):
    job = BUNDLE.jobs[job_key]
    keys = [t.key for t in job.tasks]
    assert len(keys) == len(set(keys)), f"duplicate task_key in {keys}"
    for task in job.tasks:
        assert set(task.depends_on) <= set(keys), f"{task.key} depends on unknown {set(task.depends_on) - set(keys)}"
    assert len(task_order(job)) == len(keys)  # raises on a cycle


@pytest.mark.parametrize(("job_key", "task_key"), TASKS)
def test_notebook_exists_and_is_valid_v4_python(job_key, task_key):
    path = _task(job_key, task_key).notebook
    assert path.is_file(), f"{job_key}.{task_key}: notebook {path} does not exist"
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert nb.nbformat == 4
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("language") == "python", f"{path.name}: kernelspec is not python"


NON_PYTHON_CELLS = {"%sql", "%sh", "%scala", "%r", "%md", "%fs"}


def notebook_widgets(path: Path) -> dict[str, bool]:
    """Widget name -> whether the call gives an explicit default, from every ``widget(...)`` / ``path_widget(...)`` /
    ``int_widget(...)`` call."""
    nb = nbformat.read(path, as_version=4)
    widgets: dict[str, bool] = {}
    for cell in nb.cells:
        first = (cell.source.lstrip().split(maxsplit=1) or [""])[0]
        if cell.cell_type != "code" or first.startswith("%%") or first in NON_PYTHON_CELLS:
            continue  # a %%bash or Databricks %sql cell is not Python
        # Line magics and shell escapes are not Python either; blank them so the rest parses.
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        for node in ast.walk(ast.parse(source, filename=f"{path.name}")):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name not in ("widget", "path_widget", "int_widget"):  # a widget whose value is then read as a path / a number
                continue
            assert node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str), (
                f"{path.name}: widget name must be a string literal so the bundle can be checked: {ast.unparse(node)}"
            )
            has_default = len(node.args) > 1 or any(k.arg == "default" for k in node.keywords)
            widgets[node.args[0].value] = widgets.get(node.args[0].value, False) or has_default
    return widgets


def test_widget_parser_reads_names_and_defaults(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell('%pip install x\nfrom rulewatch.spark.present.widgets import widget\na = widget("a")\nb = widget("b", "1")'),
        nbformat.v4.new_code_cell('%sql SELECT widget("nope")'),
        nbformat.v4.new_code_cell('import rulewatch.spark.present.widgets as w\nc = int(w.widget("c", default="2"))\nprint("widget(\\"d\\")")'),
        nbformat.v4.new_code_cell('from rulewatch.spark.present.widgets import int_widget\ne = int_widget("e", 3)'),
    ]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert notebook_widgets(path) == {"a": False, "b": True, "c": True, "e": True}


@pytest.mark.parametrize(("job_key", "task_key"), TASKS)
def test_base_parameters_are_the_notebooks_widgets(job_key, task_key):
    job: JobSpec = BUNDLE.jobs[job_key]
    task = _task(job_key, task_key)
    widgets = notebook_widgets(task.notebook)
    assert widgets, f"{task.notebook.name} declares no widgets"
    undeclared = set(task.base_parameters) - set(widgets)
    assert not undeclared, f"{job_key}.{task_key}: base_parameters {sorted(undeclared)} are not widgets of {task.notebook.name}"
    # Databricks pushes job parameters down to every notebook task, so those give a value too.
    unset = {w for w, has_default in widgets.items() if not has_default} - set(task.base_parameters) - set(job.parameters)
    assert not unset, f"{job_key}.{task_key}: widgets {sorted(unset)} of {task.notebook.name} have no default and no value"
    for name, value in task.base_parameters.items():
        # A pushed-down job parameter wins over a task parameter of the same name, so anything
        # else written here would be silently ignored on Databricks.
        if name in job.parameters:
            assert value == f"{{{{job.parameters.{name}}}}}", f"{job_key}.{task_key}: {name}={value!r} is overridden by job parameter {name}"


# ---- deployment settings: schedule, notifications, retries, compute, targets ------------------------

ROOT_CONFIG = yaml.safe_load((ROOT / "databricks.yml").read_text())


def test_targets_dev_is_the_default_development_target_and_prod_is_production():
    targets = ROOT_CONFIG["targets"]
    assert targets["dev"]["mode"] == "development" and targets["dev"].get("default") is True
    assert targets["prod"]["mode"] == "production"
    assert targets["prod"]["workspace"]["root_path"].startswith("/Workspace/")
    # prod runs as the service principal, which also deploys it and so keeps CAN_MANAGE on it.
    assert targets["prod"]["run_as"] == {"service_principal_name": "${var.service_principal}"}
    levels = {p.get("group_name") or p.get("service_principal_name"): p["level"] for p in targets["prod"]["permissions"]}
    assert levels == {"${var.service_principal}": "CAN_MANAGE", "fraud-analysts": "CAN_VIEW", "fraud-engineers": "CAN_MANAGE"}
    assert "run_as" not in targets["dev"]  # dev runs as the developer who deploys it


def test_the_cli_version_floor_admits_dashboard_dataset_defaults():
    constraint = ROOT_CONFIG["bundle"]["databricks_cli_version"]
    assert cli_version_floor(constraint) == DASHBOARD_DATASET_DEFAULTS_CLI == (0, 281, 0)


def test_no_workspace_host_or_secret_in_the_bundle():
    for path in BUNDLE.files:
        text = path.read_text()
        assert "host:" not in text, f"{path.name}: the workspace host comes from the environment, not the repo"
        for marker in ("dapi", "token:", "client_secret", "password"):
            assert marker not in text.lower(), f"{path.name}: looks like a credential ({marker})"


def test_wheel_artifact_is_built_from_this_project():
    artifact = ROOT_CONFIG["artifacts"]["rulewatch_wheel"]
    assert artifact["type"] == "whl" and artifact["path"] == "."
    assert "dist" in artifact["build"]


def test_variables_the_deploy_docs_describe_are_declared():
    declared = ROOT_CONFIG["variables"]
    documented = (ROOT / "docs" / "deploy.md").read_text()
    for name in declared:
        assert declared[name].get("description"), f"variable {name} is undocumented in databricks.yml"
        assert f"`{name}`" in documented, f"variable {name} is not in docs/deploy.md"
    # A list default is only accepted by the CLI on a variable declared complex.
    assert declared["notification_emails"]["type"] == "complex" and declared["notification_emails"]["default"] == []
    # The dashboard's warehouse is looked up by name at deploy time, not an empty id.
    assert declared["warehouse_id"] == {"description": declared["warehouse_id"]["description"], "lookup": {"warehouse": "${var.warehouse_name}"}}
    assert "default" not in declared["service_principal"]  # a prod deploy without it must stop


SCHEDULED = [k for k in JOBS if "schedule" in BUNDLE.jobs[k].definition]
CONTINUOUS = [k for k in JOBS if "continuous" in BUNDLE.jobs[k].definition]
ON_DEMAND = [k for k in JOBS if k not in SCHEDULED + CONTINUOUS]  # run by hand, once: the rescale
TIMED = SCHEDULED + ON_DEMAND


def test_there_is_a_scheduled_job_a_continuous_live_job_and_the_rescale_on_demand():
    assert SCHEDULED == ["rulewatch_pipeline"] and CONTINUOUS == ["rulewatch_live"] and ON_DEMAND == ["rulewatch_gold_rescale"]
    assert not set(SCHEDULED) & set(CONTINUOUS)  # never both


@pytest.mark.parametrize("job_key", SCHEDULED)
def test_schedule_is_paused_in_dev_and_runs_in_prod(job_key):
    schedule = BUNDLE.jobs[job_key].definition["schedule"]
    assert schedule["quartz_cron_expression"] and schedule["timezone_id"]
    assert schedule["pause_status"] == "${var.schedule_pause_status}"
    assert _config("dev").resolved["resources"]["jobs"][job_key]["schedule"]["pause_status"] == "PAUSED"
    assert _config("prod").resolved["resources"]["jobs"][job_key]["schedule"]["pause_status"] == "UNPAUSED"


@pytest.mark.parametrize("job_key", CONTINUOUS)
def test_the_live_job_is_paused_everywhere_until_switched_on(job_key):
    # The live job and the scheduled job ingest the same lakehouse: never both running by default.
    for target in TARGETS:
        assert _config(target).resolved["resources"]["jobs"][job_key]["continuous"]["pause_status"] == "PAUSED"
    switched = _config("prod", live_pause_status="UNPAUSED", schedule_pause_status="PAUSED").resolved["resources"]["jobs"]
    assert switched[job_key]["continuous"]["pause_status"] == "UNPAUSED"
    assert switched["rulewatch_pipeline"]["schedule"]["pause_status"] == "PAUSED"


@pytest.mark.parametrize("job_key", JOBS)
def test_failures_slow_runs_and_backlogs_mail_the_notification_list(job_key):
    mail = BUNDLE.jobs[job_key].definition["email_notifications"]
    events = ["on_failure"] + (["on_streaming_backlog_exceeded"] if job_key not in ON_DEMAND else [])
    events += ["on_duration_warning_threshold_exceeded"] if job_key in TIMED else []
    for event in events:
        assert mail[event] == "${var.notification_emails}", event


@pytest.mark.parametrize("job_key", JOBS)
def test_job_has_a_timeout_health_rules_and_tags(job_key):
    definition = BUNDLE.jobs[job_key].definition
    rules = {r["metric"]: r for r in definition["health"]["rules"]}
    assert all(r["op"] == "GREATER_THAN" and r["value"] > 0 for r in rules.values())
    if job_key in TIMED:
        assert 0 < definition["timeout_seconds"] <= 4 * 3600
        backlog = {"STREAMING_BACKLOG_FILES", "STREAMING_BACKLOG_RECORDS"} if job_key in SCHEDULED else set()  # a rescale reads no landing
        assert set(rules) == {"RUN_DURATION_SECONDS", *backlog}
        # The duration warning fires before the timeout cancels the run.
        assert rules["RUN_DURATION_SECONDS"]["value"] < definition["timeout_seconds"]
    else:
        # A continuous run lasts for ever by design: no timeout, no duration rule; lag is what to watch.
        assert "timeout_seconds" not in definition
        assert set(rules) == {"STREAMING_BACKLOG_SECONDS", "STREAMING_BACKLOG_FILES", "STREAMING_BACKLOG_RECORDS"}
    for target in TARGETS:
        assert _config(target).resolved["resources"]["jobs"][job_key]["tags"] == {"project": "rulewatch", "target": target}


@pytest.mark.parametrize(("job_key", "task_key"), TASKS)
def test_tasks_get_the_wheel_on_a_declared_cluster_and_only_stream_tasks_retry(job_key, task_key):
    definition = BUNDLE.jobs[job_key].definition
    raw = next(t for t in definition["tasks"] if t["task_key"] == task_key)
    if task_key == "setup":
        # It validates the rules file and creates tables: a failure there is not transient.
        assert "max_retries" not in raw and "min_retry_interval_millis" not in raw
    else:
        # Each stream restarts from its checkpoint, so a retry after a lost executor can finish.
        assert raw["max_retries"] >= 1 and raw["min_retry_interval_millis"] >= 10_000
    clusters = {c["job_cluster_key"]: c for c in definition.get("job_clusters", [])}
    assert raw["job_cluster_key"] in clusters, f"{task_key}: job_cluster_key {raw.get('job_cluster_key')} is not declared"
    assert {"whl": "../dist/*.whl"} in raw["libraries"], f"{task_key}: the notebooks import rulewatch; the wheel must be installed"
    conf = clusters[raw["job_cluster_key"]]["new_cluster"]["spark_conf"]
    assert conf["spark.sql.streaming.stateStore.providerClass"].endswith("RocksDBStateStoreProvider")


# ---- each target as the CLI builds it, against the CLI's own JSON schema ---------------------------------

# The schema `databricks bundle schema` prints, copied as data (see its README); never skipped: a missing
# file fails the test, since the CLI itself cannot run here.
# Looked for beside the checkout (../shared), then where this machine kind keeps shared/ (a CI clone may
# sit elsewhere).
_SCHEMA_PLACES = [ROOT.parent / "shared", Path("/work/shared")]
SCHEMA_PATH = Path(
    os.environ.get("RULEWATCH_BUNDLE_SCHEMA")
    or next((p for p in (d / "databricks" / "bundle-jsonschema.json" for d in _SCHEMA_PLACES) if p.is_file()), _SCHEMA_PLACES[0] / "databricks" / "bundle-jsonschema.json")
)
TARGETS = target_names(ROOT)
SERVICE_PRINCIPAL = "6a1f3c2e-0000-4000-8000-000000000001"  # an application id, as a service principal's user name is
# Who deploys each target, as docs/deploy.md says: a developer for dev, the service principal (from CI) for prod.
DEPLOYERS = {"dev": Identity.of("alice.smith@example.com"), "prod": Identity.of(SERVICE_PRINCIPAL, service_principal=True)}
TARGET_VARS = {"prod": {"service_principal": SERVICE_PRINCIPAL}}  # prod has no default for it: CI passes --var


@pytest.fixture(scope="module")
def schema_text() -> str:
    assert SCHEMA_PATH.is_file(), f"the CLI's bundle JSON schema is missing at {SCHEMA_PATH} (set RULEWATCH_BUNDLE_SCHEMA)"
    return load_schema(SCHEMA_PATH)


def _config(target: str, **variables: str):
    return load_config(ROOT, target, {**TARGET_VARS.get(target, {}), **variables}, identity=DEPLOYERS[target], environ={}, strict=True)


def test_the_bundle_has_a_dev_and_a_prod_target():
    assert set(TARGETS) == {"dev", "prod"} == set(DEPLOYERS)


@pytest.mark.parametrize("target", TARGETS)
def test_each_targets_merged_configuration_matches_the_cli_schema(schema_text, target):
    config = _config(target)
    # Includes merged and target overrides applied, references as written (the schema allows ${...}) ...
    assert config.document["resources"]["jobs"] and config.document["resources"]["dashboards"]
    assert schema_problems(config.document, schema_text) == []
    # ... and again with every reference a deploy would resolve offline resolved (typed values included).
    assert schema_problems(config.resolved, schema_text) == []


def test_each_file_as_written_matches_the_cli_schema(schema_text):
    # Each included file is a fragment of the same root document, so one schema fits all.
    for path in BUNDLE.files:
        assert schema_problems(yaml.safe_load(path.read_text()), schema_text) == [], path.name


def test_the_whole_bundle_passes_every_offline_check(schema_text):
    assert [str(p) for p in check_bundle(ROOT, schema_text, variables=TARGET_VARS, identities=DEPLOYERS, environ={})] == []


# ---- compute=serverless: the same jobs, moved off their cluster by resources/compute.py ---------------------

SERVERLESS_VARS = {target: {**TARGET_VARS.get(target, {}), "compute": "serverless"} for target in TARGETS}
# What the switch takes off a task, and what it puts on one: nothing else may differ between the two computes.
CLUSTER_ONLY_TASK_KEYS = {"job_cluster_key", "libraries"}


def _without(job: dict, job_keys: set[str], task_keys: set[str]) -> dict:
    return {**{k: v for k, v in job.items() if k not in job_keys}, "tasks": [{k: v for k, v in t.items() if k not in task_keys} for t in job["tasks"]]}


@pytest.mark.parametrize("target", TARGETS)
def test_each_targets_serverless_configuration_matches_the_cli_schema(schema_text, target):
    config = _config(target, compute="serverless")
    assert config.variables["compute"] == "serverless"
    assert schema_problems(config.document, schema_text) == []
    assert schema_problems(config.resolved, schema_text) == []


def test_the_whole_serverless_bundle_passes_every_offline_check(schema_text):
    assert [str(p) for p in check_bundle(ROOT, schema_text, variables=SERVERLESS_VARS, identities=DEPLOYERS, environ={})] == []


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("job_key", JOBS)
def test_serverless_jobs_have_no_cluster_and_every_task_gets_the_wheel_from_one_environment(target, job_key):
    job = _config(target, compute="serverless").document["resources"]["jobs"][job_key]
    assert "job_clusters" not in job
    (environment,) = job["environments"]
    # Environment 4: Python 3.12 and Databricks Connect 17, the Spark 4 line of the clusters' 17.3 floor.
    assert environment == {"environment_key": "rulewatch", "spec": {"environment_version": "4", "dependencies": ["../dist/*.whl"]}}
    for task in job["tasks"]:
        assert task["environment_key"] == "rulewatch", task["task_key"]
        assert not CLUSTER_ONLY_TASK_KEYS & set(task), task["task_key"]
    # Everything else (tasks, parameters, schedule, retries, health) is the cluster job's.
    cluster = _config(target).document["resources"]["jobs"][job_key]
    assert _without(job, {"environments"}, {"environment_key"}) == _without(cluster, {"job_clusters"}, CLUSTER_ONLY_TASK_KEYS)


def test_cluster_is_the_default_compute_and_leaves_the_jobs_as_written():
    for target in TARGETS:
        assert _config(target).document["resources"]["jobs"] == _config(target, compute="cluster").document["resources"]["jobs"]
    for job_key in JOBS:
        assert BUNDLE.jobs[job_key].definition == yaml.safe_load(BUNDLE.jobs[job_key].source.read_text())["resources"]["jobs"][job_key]


@pytest.mark.parametrize("compute", ["cluster", "serverless"])
def test_the_local_runner_runs_the_same_task_graph_whatever_the_compute(compute):
    # `rulewatch job run` runs every notebook here; the compute only decides where a deploy runs them.
    local = load_bundle(ROOT, {"compute": compute})
    assert local.variables["compute"] == compute
    for job_key in JOBS:
        assert local.jobs[job_key].tasks == BUNDLE.jobs[job_key].tasks
        assert local.jobs[job_key].parameters == BUNDLE.jobs[job_key].parameters


def test_an_unknown_compute_is_refused_naming_the_values(schema_text):
    problems = [str(p) for p in check_bundle(ROOT, schema_text, variables={t: {**v, "compute": "gpu"} for t, v in SERVERLESS_VARS.items()}, identities=DEPLOYERS, environ={})]
    for target in TARGETS:
        assert any(
            p.startswith(f"[{target}] configuration:") and "python mutator resources.compute:choose_compute" in p
            and "variable compute is 'gpu'; set it to one of cluster, serverless (e.g. --var compute=serverless)" in p
            for p in problems
        ), problems  # fmt: skip
    with pytest.raises(JobError, match="variable compute is 'gpu'"):
        load_bundle(ROOT, {"compute": "gpu"})


def test_serverless_without_the_mutator_is_caught(schema_text, tmp_path):
    # The YAML alone keeps every cluster key: dropping the mutator from databricks.yml must not deploy
    # a "serverless" job that still asks for its cluster.
    root = _copy_bundle(tmp_path)
    text = (root / "databricks.yml").read_text()
    unmutated = text.replace("python:\n  mutators:\n    - resources.compute:choose_compute\n", "")
    assert unmutated != text
    (root / "databricks.yml").write_text(unmutated)
    assert [str(p) for p in check_bundle(root, schema_text, variables=TARGET_VARS, identities=DEPLOYERS, environ={})] == []
    problems = [str(p) for p in check_bundle(root, schema_text, variables=SERVERLESS_VARS, identities=DEPLOYERS, environ={})]
    for target in TARGETS:
        for job_key in JOBS:
            mine = [p for p in problems if p.startswith(f"[{target}]") and f"resources.jobs.{job_key}" in p]
            assert any("has job_clusters with compute=serverless" in p for p in mine), mine
            for task in BUNDLE.jobs[job_key].tasks:
                for expected in ("has job_cluster_key with compute=serverless", "has libraries with compute=serverless", "has no environment_key"):
                    assert any(f".tasks[{task.key}]: {expected}" in p and "resources.compute:choose_compute" in p for p in mine), (expected, mine)


def _copy_bundle(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    shutil.copy(ROOT / "databricks.yml", root / "databricks.yml")
    for folder in ("resources", "notebooks"):
        shutil.copytree(ROOT / folder, root / folder)
    return root


def test_a_deliberately_broken_file_is_caught(schema_text, tmp_path):
    root = _copy_bundle(tmp_path)
    job_file = root / "resources" / "rulewatch.job.yml"
    text = job_file.read_text()
    broken = text.replace("max_concurrent_runs: 1", "max_concurent_runs: 1").replace("timeout_seconds: 3600", "timeout_seconds: an hour")
    broken = broken.replace("op: GREATER_THAN", "op: MORE_THAN", 1)
    assert broken.count("max_concurent_runs") == 1 and "an hour" in broken and "MORE_THAN" in broken
    job_file.write_text(broken)
    problems = [str(p) for p in check_bundle(root, schema_text, variables=TARGET_VARS, identities=DEPLOYERS, environ={})]
    for target in ("dev", "prod"):
        merged = [p for p in problems if p.startswith(f"[{target}] schema (merged configuration)")]
        assert any("Additional properties are not allowed ('max_concurent_runs' was unexpected)" in p for p in merged), problems
        assert any("rulewatch_pipeline/timeout_seconds: 'an hour' is not of type 'integer'" in p for p in merged), problems
        assert any("health/rules/0/op: 'MORE_THAN' is not one of ['GREATER_THAN']" in p for p in merged), problems
    assert any(p.startswith("[all targets]") and "rulewatch.job.yml (as written)" in p and "max_concurent_runs" in p for p in problems)


def test_what_the_jobs_service_refuses_in_a_continuous_job_is_caught(schema_text, tmp_path):
    root = _copy_bundle(tmp_path)
    job_file = root / "resources" / "rulewatch_live.job.yml"
    text = job_file.read_text().replace("task_retry_mode: ON_FAILURE", "task_retry_mode: NEVER")
    text = text.replace("      tasks:\n", "      schedule:\n        quartz_cron_expression: 0 0 * * * ?\n        timezone_id: UTC\n      tasks:\n")
    text = text.replace("          job_cluster_key: rulewatch\n          libraries:", "          job_cluster_key: rulewatch\n          depends_on:\n            - task_key: live\n          libraries:")
    job_file.write_text(text)
    problems = [str(p) for p in check_bundle(root, schema_text, variables=TARGET_VARS, identities=DEPLOYERS, environ={})]
    for expected in ("a continuous job cannot also have a schedule", "a continuous job's tasks cannot depend on each other",
                     "max_retries in a continuous job needs continuous.task_retry_mode ON_FAILURE"):  # fmt: skip
        assert any(expected in p and "rulewatch_live" in p for p in problems), (expected, problems)


def test_the_schema_check_runs_on_the_regex_engine_the_patterns_need(schema_text):
    # The schema's ${...} alternatives use \p{L}; Python's re would reject them, so a pass here means the
    # patterns really ran: a bad reference string in an integer field must fail them.
    config = _config("dev")
    document = copy.deepcopy(config.document)
    document["resources"]["jobs"]["rulewatch_pipeline"]["timeout_seconds"] = "${var.timeout"
    assert any("timeout_seconds" in line for line in schema_problems(document, schema_text))
    document["resources"]["jobs"]["rulewatch_pipeline"]["timeout_seconds"] = "${var.run_timeout}"
    assert schema_problems(document, schema_text) == []


def test_a_file_that_is_not_a_json_schema_is_refused(tmp_path):
    bad = tmp_path / "schema.json"
    bad.write_text('{"type": 5}')
    with pytest.raises(BundleError, match="not a valid JSON schema"):
        schema_problems({}, load_schema(bad))
    with pytest.raises(BundleError, match="cannot read"):
        load_schema(tmp_path / "missing.json")


# ---- targets never share data ----------------------------------------------------------------------------


def test_dev_and_prod_resolve_to_separate_catalogs_schemas_volumes_and_checkpoints():
    dev, prod = _config("dev"), _config("prod")
    assert (dev.variables["catalog"], dev.variables["schema"]) == ("main", "rulewatch_dev_alice_smith")
    assert (prod.variables["catalog"], prod.variables["schema"]) == ("main", "rulewatch")
    assert dev.variables["lakehouse"] == "/Volumes/main/rulewatch_dev_alice_smith/lakehouse"
    assert dev.variables["landing"] == "/Volumes/main/rulewatch_dev_alice_smith/landing"
    assert prod.variables["lakehouse"] == "/Volumes/main/rulewatch/lakehouse"
    assert prod.variables["landing"] == "/Volumes/main/rulewatch/landing"
    assert Lakehouse(dev.variables["lakehouse"]).checkpoint("bronze") != Lakehouse(prod.variables["lakehouse"]).checkpoint("bronze")
    assert isolation_problems({"dev": dev, "prod": prod}) == []
    # What the deployed job and dashboard actually get, not only the variables:
    for config in (dev, prod):
        job = config.resolved["resources"]["jobs"]["rulewatch_pipeline"]
        defaults = {p["name"]: p["default"] for p in job["parameters"]}
        assert (defaults["lakehouse"], defaults["landing"]) == (config.variables["lakehouse"], config.variables["landing"])
        # Managed tables in the target's own schema (Lakehouse.schema), not folders in a shared volume.
        assert defaults["tables"] == f"{config.variables['catalog']}.{config.variables['schema']}"
        setup = next(t for t in job["tasks"] if t["task_key"] == "setup")["notebook_task"]["base_parameters"]
        assert (setup["catalog"], setup["schema"]) == (config.variables["catalog"], config.variables["schema"])
        dashboard = config.resolved["resources"]["dashboards"]["rulewatch_dashboard"]
        assert (dashboard["dataset_catalog"], dashboard["dataset_schema"]) == (config.variables["catalog"], config.variables["schema"])


def test_two_developers_get_two_dev_schemas():
    alice = _config("dev")
    bob = load_config(ROOT, "dev", identity=Identity.of("bob@example.com"), environ={}, strict=True)
    assert bob.variables["lakehouse"] == "/Volumes/main/rulewatch_dev_bob/lakehouse"
    assert isolation_problems({"dev-alice": alice, "dev-bob": bob}) == []


def test_every_path_is_derived_from_catalog_and_schema():
    # Overriding only catalog/schema moves every volume: no separately written path can drift.
    moved = _config("prod", catalog="fraud", schema="rw")
    assert (moved.variables["lakehouse"], moved.variables["landing"]) == ("/Volumes/fraud/rw/lakehouse", "/Volumes/fraud/rw/landing")
    declared = ROOT_CONFIG["variables"]
    for name in ("lakehouse", "landing"):
        assert "${var.catalog}" in declared[name]["default"] and "${var.schema}" in declared[name]["default"]
    assert "default" not in declared["catalog"] and "default" not in declared["schema"]  # each target must choose
    assert all({"catalog", "schema"} <= set((t or {}).get("variables") or {}) for t in ROOT_CONFIG["targets"].values())
    assert "/Volumes/" not in (ROOT / "resources" / "rulewatch.job.yml").read_text()


def test_a_target_that_shares_prods_data_is_caught():
    prod = _config("prod")
    copy_of_prod = _config("dev", schema="rulewatch")
    problems = [str(p) for p in isolation_problems({"prod": prod, "staging": copy_of_prod})]
    assert any("both targets use main.rulewatch" in p for p in problems)
    assert any("checkpoints: both targets use /Volumes/main/rulewatch/lakehouse/_checkpoints/" in p for p in problems)
    outside = _config("dev", lakehouse="/Volumes/main/rulewatch/lakehouse")
    assert any("not a volume of the target's own schema" in str(p) for p in isolation_problems({"dev": outside}))
    into_prods_tables = _config("dev", tables="main.rulewatch")
    assert any("'main.rulewatch' is not the target's own schema main.rulewatch_dev_alice_smith" in str(p) for p in isolation_problems({"dev": into_prods_tables}))


# ---- the dashboard resource ------------------------------------------------------------------------

DASHBOARDS = {
    key: (path, definition)
    for path in BUNDLE.files
    for key, definition in ((yaml.safe_load(path.read_text()).get("resources") or {}).get("dashboards") or {}).items()
}


def test_dashboard_resource_loads_with_the_typed_class_and_reads_the_bundle_catalog_and_schema():
    from databricks.bundles.dashboards import Dashboard

    assert list(DASHBOARDS) == ["rulewatch_dashboard"]
    _, definition = DASHBOARDS["rulewatch_dashboard"]
    assert Dashboard.from_dict(copy.deepcopy(definition)).as_dict() == definition
    # The datasets name views unqualified; these put them in the schema the views are created in.
    assert definition["dataset_catalog"] == "${var.catalog}" and definition["dataset_schema"] == "${var.schema}"
    assert definition["warehouse_id"] == "${var.warehouse_id}"  # a warehouse lookup by name (databricks.yml)
    assert definition["embed_credentials"] is False  # the views mask per viewer, so each viewer queries as themselves
    assert ROOT_CONFIG["variables"]["pii_viewer_group"]["description"]


def test_dashboard_file_is_a_consistent_lakeview_definition():
    path, definition = DASHBOARDS["rulewatch_dashboard"]
    file = (path.parent / definition["file_path"]).resolve()
    assert file.name.endswith(".lvdash.json") and file.is_file(), f"{definition['file_path']} not found next to {path.name}"
    dashboard = json.loads(file.read_text())
    names = [d["name"] for d in dashboard["datasets"]]
    assert len(names) == len(set(names)) and all(d["queryLines"] for d in dashboard["datasets"])
    pages = [(p["displayName"], p.get("pageType")) for p in dashboard["pages"]]
    # Two canvases, and the page whose filters apply to every page (event date, rule).
    assert pages == [("Alerts overview", "PAGE_TYPE_CANVAS"), ("Operations", "PAGE_TYPE_CANVAS"), ("Filters", "PAGE_TYPE_GLOBAL_FILTERS")]
    for page in dashboard["pages"]:
        widgets = [item["widget"]["name"] for item in page["layout"]]
        assert len(widgets) == len(set(widgets)), f"{page['name']}: duplicate widget names"
        for item in page["layout"]:
            pos = item["position"]
            assert 0 <= pos["x"] and pos["width"] >= 1 and pos["x"] + pos["width"] <= 6, f"{item['widget']['name']}: off the 6-column grid"
            for query in item["widget"].get("queries", []):
                assert query["query"]["datasetName"] in names, f"{item['widget']['name']}: unknown dataset"
