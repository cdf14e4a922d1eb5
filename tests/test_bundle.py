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
import subprocess
from pathlib import Path

import nbformat
import pytest
import yaml
from databricks.bundles.jobs import Job

from conftest import ROOT
from rulewatch.jobs import JobSpec, load_bundle, task_order

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
    """Widget name -> whether the call gives an explicit default, from every ``widget(...)`` call."""
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
            if name != "widget":
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
        nbformat.v4.new_code_cell('%pip install x\nfrom rulewatch.widgets import widget\na = widget("a")\nb = widget("b", "1")'),
        nbformat.v4.new_code_cell('%sql SELECT widget("nope")'),
        nbformat.v4.new_code_cell('import rulewatch.widgets as w\nc = int(w.widget("c", default="2"))\nprint("widget(\\"d\\")")'),
    ]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert notebook_widgets(path) == {"a": False, "b": True, "c": True}


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


# ---- the Databricks CLI's own JSON schema for bundle config ---------------------------------------

CLI_HOME = Path(os.environ.get("RULEWATCH_HOME", Path.home() / ".cache" / "rulewatch")) / "bin"
GET_CLI = "GOBIN=~/.cache/rulewatch/bin go install github.com/databricks/cli@latest"


def _bundle_schema() -> dict:
    """``databricks bundle schema`` from a cached or installed CLI; skip when there is none."""
    candidates = [CLI_HOME / "databricks", shutil.which("databricks")]
    for binary in [c for c in candidates if c and Path(c).is_file()]:
        done = subprocess.run([str(binary), "bundle", "schema"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return json.loads(done.stdout)
    pytest.skip(f"no Databricks CLI with `bundle schema` in {CLI_HOME} or on PATH; to enable: {GET_CLI}")


def test_bundle_files_match_the_databricks_cli_schema():
    import jsonschema

    schema = _bundle_schema()
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = validator_class(schema)
    problems = []
    for path in BUNDLE.files:
        # Each included file is a fragment of the same root document, so one schema fits all.
        for error in validator.iter_errors(yaml.safe_load(path.read_text())):
            # Every schema node is oneOf(object, "${var...}" string); best_match reports the object branch's complaint.
            error = jsonschema.exceptions.best_match([error])
            problems.append(f"{path.relative_to(ROOT)}: {'/'.join(map(str, error.absolute_path))}: {error.message}")
    assert not problems, "\n".join(problems)


# ---- deployment settings: schedule, notifications, retries, compute, targets ------------------------

ROOT_CONFIG = yaml.safe_load((ROOT / "databricks.yml").read_text())


def _target_variables(target: str) -> dict[str, str]:
    return dict((ROOT_CONFIG["targets"][target] or {}).get("variables") or {})


def test_targets_dev_is_the_default_development_target_and_prod_is_production():
    targets = ROOT_CONFIG["targets"]
    assert targets["dev"]["mode"] == "development" and targets["dev"].get("default") is True
    assert targets["prod"]["mode"] == "production"
    assert targets["prod"]["workspace"]["root_path"].startswith("/Workspace/")
    levels = {p.get("group_name"): p["level"] for p in targets["prod"]["permissions"]}
    assert levels == {"fraud-analysts": "CAN_VIEW", "fraud-engineers": "CAN_MANAGE"}


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
    for name in ("catalog", "schema", "lakehouse", "landing", "warehouse_id", "notification_emails", "schedule_pause_status"):
        assert name in declared and declared[name].get("description"), f"variable {name} missing or undocumented"
    # A list default is only accepted by the CLI on a variable declared complex.
    assert declared["notification_emails"]["type"] == "complex" and declared["notification_emails"]["default"] == []


@pytest.mark.parametrize("job_key", JOBS)
def test_schedule_is_paused_in_dev_and_runs_in_prod(job_key):
    schedule = BUNDLE.jobs[job_key].definition["schedule"]
    assert schedule["quartz_cron_expression"] and schedule["timezone_id"]
    assert load_bundle(ROOT, _target_variables("dev")).variables["schedule_pause_status"] == "PAUSED"
    assert load_bundle(ROOT, _target_variables("prod")).variables["schedule_pause_status"] == "UNPAUSED"
    assert schedule["pause_status"] == "${var.schedule_pause_status}"


@pytest.mark.parametrize("job_key", JOBS)
def test_failures_mail_the_notification_list(job_key):
    assert BUNDLE.jobs[job_key].definition["email_notifications"]["on_failure"] == "${var.notification_emails}"


@pytest.mark.parametrize(("job_key", "task_key"), TASKS)
def test_every_task_retries_and_gets_the_wheel_on_a_declared_cluster(job_key, task_key):
    definition = BUNDLE.jobs[job_key].definition
    raw = next(t for t in definition["tasks"] if t["task_key"] == task_key)
    assert raw["max_retries"] >= 1 and raw["min_retry_interval_millis"] >= 10_000
    clusters = {c["job_cluster_key"]: c for c in definition.get("job_clusters", [])}
    assert raw["job_cluster_key"] in clusters, f"{task_key}: job_cluster_key {raw.get('job_cluster_key')} is not declared"
    assert {"whl": "../dist/*.whl"} in raw["libraries"], f"{task_key}: the notebooks import rulewatch; the wheel must be installed"
    conf = clusters[raw["job_cluster_key"]]["new_cluster"]["spark_conf"]
    assert conf["spark.sql.streaming.stateStore.providerClass"].endswith("RocksDBStateStoreProvider")


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
    assert definition["warehouse_id"] == "${var.warehouse_id}"
    assert ROOT_CONFIG["variables"]["pii_viewer_group"]["description"]


def test_dashboard_file_is_a_consistent_lakeview_definition():
    path, definition = DASHBOARDS["rulewatch_dashboard"]
    file = (path.parent / definition["file_path"]).resolve()
    assert file.name.endswith(".lvdash.json") and file.is_file(), f"{definition['file_path']} not found next to {path.name}"
    dashboard = json.loads(file.read_text())
    names = [d["name"] for d in dashboard["datasets"]]
    assert len(names) == len(set(names)) and all(d["queryLines"] for d in dashboard["datasets"])
    assert [p["displayName"] for p in dashboard["pages"]] == ["Alerts overview", "Operations"]
    for page in dashboard["pages"]:
        widgets = [item["widget"]["name"] for item in page["layout"]]
        assert len(widgets) == len(set(widgets)), f"{page['name']}: duplicate widget names"
        for item in page["layout"]:
            pos = item["position"]
            assert 0 <= pos["x"] and pos["width"] >= 1 and pos["x"] + pos["width"] <= 6, f"{item['widget']['name']}: off the 6-column grid"
            for query in item["widget"].get("queries", []):
                assert query["query"]["datasetName"] in names, f"{item['widget']['name']}: unknown dataset"
