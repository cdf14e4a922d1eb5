"""The bundle configuration built as the Databricks CLI builds it, and the CLI's code-level rules, on small bundles.

tests/test_bundle.py checks the repository's own bundle with these; here each rule is shown to fire on a
bundle that breaks it (and only then), so a passing repository check means something.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rulewatch.bundle.check import check_target, cli_version_floor, rule_problems, undefined_references
from rulewatch.bundle.config import BundleError, Identity, Lookup, load_config

ALICE = Identity.of("alice.smith@example.com")
SP = Identity.of("6a1f3c2e-0000-4000-8000-000000000001", service_principal=True)


def write_bundle(root: Path, document: dict[str, Any], resources: dict[str, Any] | None = None) -> Path:
    """databricks.yml (+ resources/main.yml when given) and an existing notebook at notebooks/nb.ipynb."""
    (root / "resources").mkdir(parents=True, exist_ok=True)
    (root / "notebooks").mkdir(exist_ok=True)
    (root / "notebooks" / "nb.ipynb").write_text("{}")
    (root / "dashboard.lvdash.json").write_text("{}")
    if resources is not None:
        document = {**document, "include": ["resources/*.yml"]}
        (root / "resources" / "main.yml").write_text(yaml.safe_dump({"resources": resources}))
    (root / "databricks.yml").write_text(yaml.safe_dump({"bundle": {"name": "tiny"}, **document}))
    return root


def _job(**extra: Any) -> dict[str, Any]:
    task = {"task_key": "a", "job_cluster_key": "c", "notebook_task": {"notebook_path": "../notebooks/nb.ipynb"}}
    return {"name": "tiny", "job_clusters": [{"job_cluster_key": "c", "new_cluster": {"num_workers": 1}}], "tasks": [task], **extra}


# ---- resolution ----------------------------------------------------------------------------------------------


def test_nested_references_types_and_precedence_follow_the_cli(tmp_path):
    root = write_bundle(
        tmp_path,
        {
            "variables": {
                "catalog": {"default": "main"},
                "schema": {},
                "volume": {"default": "/Volumes/${var.catalog}/${var.schema}/v"},  # nested
                "path": {"default": "${var.volume}/tables"},  # two levels down
                "emails": {"type": "complex", "default": ["a@example.com"]},
                "retries": {"default": 3},
                "literal": {"default": "$${var.catalog} stays"},
                "who": {"default": "${workspace.current_user.short_name}@${bundle.name}/${bundle.target}"},
            },
            "targets": {"dev": {"variables": {"schema": "s_${workspace.current_user.short_name}"}}},
        },
        {"jobs": {"j": _job(max_concurrent_runs="${var.retries}", email_notifications={"on_failure": "${var.emails}"})}},
    )
    config = load_config(root, "dev", identity=ALICE, environ={})
    assert config.variables["path"] == "/Volumes/main/s_alice_smith/v/tables"
    assert config.variables["literal"] == "$${var.catalog} stays"
    assert config.variables["who"] == "alice_smith@tiny/dev"
    job = config.resolved["resources"]["jobs"]["j"]
    assert job["max_concurrent_runs"] == 3 and job["email_notifications"]["on_failure"] == ["a@example.com"]  # types kept
    assert config.document["resources"]["jobs"]["j"]["max_concurrent_runs"] == "${var.retries}"  # the document as written

    # --var beats BUNDLE_VAR_, which beats the target's value, which beats the default.
    assert load_config(root, "dev", identity=ALICE, environ={"BUNDLE_VAR_schema": "env"}).variables["schema"] == "env"
    assert load_config(root, "dev", {"schema": "flag"}, identity=ALICE, environ={"BUNDLE_VAR_schema": "env"}).variables["schema"] == "flag"
    # Without a deployer, what only a deploy knows stays as written.
    assert load_config(root, "dev", environ={}).variables["schema"] == "s_${workspace.current_user.short_name}"


def test_reference_errors_name_the_file_and_key(tmp_path):
    root = write_bundle(
        tmp_path,
        {"variables": {"a": {"default": "${var.b}"}, "b": {"default": "x${var.a}"}, "emails": {"type": "complex", "default": []}}},
        {"jobs": {"j": _job(description="${var.nope}")}},
    )
    with pytest.raises(BundleError) as err:
        load_config(root, None, environ={})
    assert "cycle in variable references" in str(err.value) or "unknown variable ${var.nope}" in str(err.value)
    write_bundle(tmp_path, {"variables": {"emails": {"type": "complex", "default": []}}}, {"jobs": {"j": _job(description="${var.nope}")}})
    with pytest.raises(BundleError, match=r"resources/main.yml: resources.jobs.j.description: unknown variable \$\{var.nope\}"):
        load_config(root, None, environ={})
    write_bundle(tmp_path, {"variables": {"a": {"default": "${var.b}"}, "b": {"default": "x${var.a}"}}}, {"jobs": {"j": _job(description="${var.a}")}})
    with pytest.raises(BundleError, match="cycle in variable references"):
        load_config(root, None, environ={})
    write_bundle(tmp_path, {"variables": {"emails": {"type": "complex", "default": []}}}, {"jobs": {"j": _job(description="to ${var.emails}")}})
    with pytest.raises(BundleError, match="only a whole value can be one"):
        load_config(root, None, environ={})
    with pytest.raises(BundleError, match="complex"):
        load_config(root, None, {"emails": "a@b"}, environ={})


def test_target_overrides_merge_like_the_cli(tmp_path):
    root = write_bundle(
        tmp_path,
        {
            "variables": {"wh": {"lookup": {"warehouse": "Shared"}}, "n": {"default": "1"}},
            "permissions": [{"group_name": "g", "level": "CAN_VIEW"}],
            "run_as": {"user_name": "base@example.com"},
            "targets": {
                "dev": {
                    "variables": {"wh": "abc123", "n": {"lookup": {"cluster": "c"}}},  # a default replaces a lookup, and back
                    "permissions": [{"user_name": "alice@example.com", "level": "CAN_MANAGE"}],
                    "run_as": {"service_principal_name": "sp"},
                    "resources": {"jobs": {"j": {"tasks": [{"task_key": "a", "max_retries": 1}]}}},
                }
            },
        },
        {"jobs": {"j": _job()}},
    )
    config = load_config(root, "dev", environ={})
    assert config.variables["wh"] == "abc123" and config.variables["n"] == Lookup("cluster", "c")
    assert [p.get("group_name") or p.get("user_name") for p in config.resolved["permissions"]] == ["g", "alice@example.com"]  # appended
    assert config.resolved["run_as"] == {"service_principal_name": "sp"}  # replaced, not merged
    (task,) = config.resolved["resources"]["jobs"]["j"]["tasks"]  # same task_key: one task, merged
    assert task["max_retries"] == 1 and task["notebook_task"]["notebook_path"] == "../notebooks/nb.ipynb"
    assert "mode" not in config.document.get("bundle", {})  # read-only CLI fields stay out of the schema-checked document


def test_a_lookup_is_left_to_the_deploy_and_a_var_skips_it(tmp_path):
    root = write_bundle(
        tmp_path,
        {"variables": {"name": {"default": "Shared WH"}, "wh": {"lookup": {"warehouse": "${var.name}"}}}},
        {"dashboards": {"d": {"display_name": "d", "file_path": "../dashboard.lvdash.json", "warehouse_id": "${var.wh}"}}},
    )
    config = load_config(root, None, environ={})
    assert config.variables["wh"] == Lookup("warehouse", "Shared WH")
    assert config.resolved["resources"]["dashboards"]["d"]["warehouse_id"] == "${var.wh}"
    assert load_config(root, None, {"wh": "abc"}, environ={}).resolved["resources"]["dashboards"]["d"]["warehouse_id"] == "abc"
    write_bundle(tmp_path, {"variables": {"a": {"lookup": {"warehouse": "x"}}, "b": {"lookup": {"warehouse": "${var.a}"}}}})
    with pytest.raises(BundleError, match="cannot contain references to another lookup"):
        load_config(root, None, environ={})


def test_strict_loading_needs_every_variable_and_declared_overrides(tmp_path):
    root = write_bundle(tmp_path, {"variables": {"sp": {}, "x": {"default": "1"}}, "targets": {"prod": {}, "dev": {"variables": {"nope": "1"}}}})
    assert load_config(root, "prod", environ={}).unset == ("sp",)  # fine until something references it ...
    with pytest.raises(BundleError, match="no value assigned to required variable sp in target prod; give each with --var"):
        load_config(root, "prod", environ={}, strict=True)  # ... but the CLI demands every variable
    assert load_config(root, "prod", environ={"BUNDLE_VAR_sp": "1"}, strict=True).variables["sp"] == "1"
    with pytest.raises(BundleError, match="variable nope is not defined but is assigned a value"):
        load_config(root, "dev", environ={})
    with pytest.raises(BundleError, match="no target 'qa'"):
        load_config(root, "qa", environ={})


# ---- the CLI's code-level rules --------------------------------------------------------------------------------


def _problems(root: Path, target: str, identity: Identity | None, **variables: str) -> list[str]:
    config, problems = check_target(root, target, None, variables=variables, identity=identity, environ={})
    return [p.message for p in problems]


def test_production_needs_run_as_unless_a_service_principal_deploys(tmp_path):
    root = write_bundle(tmp_path, {"targets": {"prod": {"mode": "production"}}}, {"jobs": {"j": _job()}})
    assert any("'run_as' must be set for all jobs when using 'mode: production'" in m for m in _problems(root, "prod", ALICE))
    assert _problems(root, "prod", SP) == []
    write_bundle(tmp_path, {"variables": {"sp": {}}, "targets": {"prod": {"mode": "production", "run_as": {"service_principal_name": "${var.sp}"}}}}, {"jobs": {"j": _job()}})
    assert _problems(root, "prod", ALICE, sp="x") == []
    assert any("must name exactly one identity" in m for m in _problems(root, "prod", ALICE, sp=""))
    assert any("no value assigned to required variable sp" in m for m in _problems(root, "prod", ALICE))


def test_production_permissions_must_include_the_deployer(tmp_path):
    permissions = [{"group_name": "ops", "level": "CAN_MANAGE"}]
    root = write_bundle(tmp_path, {"targets": {"prod": {"mode": "production", "permissions": permissions}}}, {"jobs": {"j": _job()}})
    assert any(f"must give the deploying identity '{SP.user_name}' CAN_MANAGE (service_principal_name" in m for m in _problems(root, "prod", SP))
    permissions.append({"service_principal_name": SP.user_name, "level": "CAN_MANAGE"})
    write_bundle(tmp_path, {"targets": {"prod": {"mode": "production", "permissions": permissions}}}, {"jobs": {"j": _job()}})
    assert _problems(root, "prod", SP) == []
    assert any("'alice.smith@example.com' CAN_MANAGE (user_name" in m for m in _problems(root, "prod", ALICE))


def test_development_paths_must_belong_to_the_developer(tmp_path):
    root = write_bundle(tmp_path, {"targets": {"dev": {"mode": "development", "workspace": {"root_path": "/Workspace/Shared/tiny"}}}})
    assert _problems(root, "dev", ALICE) == ["must start with '~/' or contain the current username when using 'mode: development'"]
    write_bundle(tmp_path, {"targets": {"dev": {"mode": "development", "workspace": {"root_path": "/Workspace/Users/${workspace.current_user.userName}/x"}}}})
    assert _problems(root, "dev", ALICE) == []


def test_a_dashboard_needs_a_warehouse_its_file_and_a_new_enough_cli(tmp_path):
    dashboard = {"display_name": "d", "file_path": "../dashboard.lvdash.json", "warehouse_id": ""}
    root = write_bundle(tmp_path, {"targets": {"dev": {}}}, {"dashboards": {"d": dashboard}})
    assert any("warehouse_id is required" in m for m in _problems(root, "dev", ALICE))
    dashboard.update(warehouse_id="abc", file_path="../missing.lvdash.json", dataset_catalog="main")
    write_bundle(tmp_path, {"targets": {"dev": {}}}, {"dashboards": {"d": dashboard}})
    messages = _problems(root, "dev", ALICE)
    assert any("file_path ../missing.lvdash.json does not exist" in m for m in messages)
    assert any("dataset_catalog/dataset_schema need CLI 0.281.0 or newer" in m for m in messages)
    dashboard.update(file_path="../dashboard.lvdash.json")
    write_bundle(tmp_path, {"bundle": {"name": "tiny", "databricks_cli_version": ">= 0.281.0"}, "targets": {"dev": {}}}, {"dashboards": {"d": dashboard}})
    assert _problems(root, "dev", ALICE) == []


def test_every_task_path_cluster_and_dependency_must_exist(tmp_path):
    job = _job()
    job["tasks"] += [
        {"task_key": "b", "depends_on": [{"task_key": "ghost"}], "job_cluster_key": "other", "notebook_task": {"notebook_path": "../notebooks/gone.ipynb"}},
        {"task_key": "c", "spark_python_task": {"python_file": "../src/gone.py"}, "libraries": [{"whl": "../dist/*.whl"}]},
    ]
    root = write_bundle(tmp_path, {"targets": {"dev": {}}}, {"jobs": {"j": job}})
    messages = _problems(root, "dev", ALICE)
    assert "depends on unknown task ghost" in messages
    assert "job_cluster_key other is not in job_clusters" in messages
    assert any("notebook_task.notebook_path ../notebooks/gone.ipynb does not exist" in m for m in messages)
    assert any("spark_python_task.python_file ../src/gone.py does not exist" in m for m in messages)
    assert any("library ../dist/*.whl is neither built by a whl artifact nor present" in m for m in messages)
    write_bundle(tmp_path, {"targets": {"dev": {}}, "artifacts": {"w": {"type": "whl", "path": "."}}}, {"jobs": {"j": _job(tasks=[{**_job()["tasks"][0], "libraries": [{"whl": "../dist/*.whl"}]}])}})
    assert _problems(root, "dev", ALICE) == []


@pytest.mark.parametrize(
    ("version", "refused"),
    [("17.3.x-scala2.13", False), ("17.3.x-photon-scala2.13", False), ("18.0.x-scala2.13", False), ("17.2.x-scala2.13", True), ("15.4.x-scala2.12", True), ("latest", True)],
)
def test_a_job_cluster_must_run_a_runtime_the_gold_layer_works_on(tmp_path, version, refused):
    job = _job()
    job["job_clusters"][0]["new_cluster"]["spark_version"] = version
    root = write_bundle(tmp_path, {"targets": {"dev": {}}}, {"jobs": {"j": job}})
    messages = _problems(root, "dev", ALICE)
    assert any(f"spark_version {version} is not Databricks Runtime 17.3 or newer" in m for m in messages) == refused
    assert len(messages) == int(refused)


def test_a_reference_to_an_undeclared_variable_is_found_in_any_file_and_target(tmp_path):
    root = write_bundle(
        tmp_path,
        {"variables": {"a": {"default": "1"}}, "targets": {"prod": {"run_as": {"user_name": "${var.prod_user}"}}}},
        {"jobs": {"j": _job(description="${var.a} ${var.typo}")}},
    )
    found = sorted(p.message for p in undefined_references(root))
    assert found == ["${var.prod_user} refers to undeclared variable prod_user", "${var.typo} refers to undeclared variable typo"]


def test_rules_pass_on_a_well_formed_production_bundle(tmp_path):
    root = write_bundle(
        tmp_path,
        {
            "variables": {"sp": {}},
            "targets": {
                "prod": {
                    "mode": "production",
                    "run_as": {"service_principal_name": "${var.sp}"},
                    "permissions": [{"service_principal_name": "${var.sp}", "level": "CAN_MANAGE"}],
                }
            },
        },
        {"jobs": {"j": _job()}},
    )
    config = load_config(root, "prod", {"sp": SP.user_name}, identity=SP, environ={}, strict=True)
    assert rule_problems(config) == []


@pytest.mark.parametrize(
    ("constraint", "floor"),
    [(">= 0.281.0", (0, 281, 0)), (">=0.281.0, <1.0.0", (0, 281, 0)), ("0.290.1", (0, 290, 1)), ("> 0.281.0", (0, 281, 1)), ("< 1.0.0", None)],
)
def test_cli_version_floor(constraint, floor):
    assert cli_version_floor(constraint) == floor


def test_job_run_reports_a_broken_bundle_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    from rulewatch.cli.main import main

    root = write_bundle(tmp_path / "b", {"variables": {}}, {"jobs": {"j": _job(description="${var.typo}")}})
    monkeypatch.chdir(root / "notebooks")  # the bundle is found upwards from here
    assert main(["job", "run", "--target", "local", "--lakehouse", str(tmp_path / "lh")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resources.jobs.j.description: unknown variable ${var.typo}" in err and "Traceback" not in err
    assert not (tmp_path / "lh").exists()  # nothing ran


# ---- python.mutators and compute=serverless ------------------------------------------------------------------

# A job mutator in the tiny bundle's resources/ (as resources/compute.py is in the real one); {body} is its return.
MUTATOR = """
from dataclasses import replace
from databricks.bundles.core import Bundle, job_mutator
from databricks.bundles.jobs import Job


@job_mutator
def mutate(bundle: Bundle, job: Job) -> Job:
    return {body}
"""


def _with_mutator(root: Path, body: str, entry: str = "resources.tweak:mutate", **document: Any) -> Path:
    write_bundle(root, {"python": {"mutators": [entry]}, "variables": {"suffix": {"default": "x"}}, "targets": {"dev": {}}, **document}, {"jobs": {"j": _job()}})
    (root / "resources" / "tweak.py").write_text(MUTATOR.format(body=body))
    return root


def test_mutators_rewrite_the_jobs_with_the_variables_before_references_resolve(tmp_path):
    root = _with_mutator(tmp_path, 'replace(job, description=f"{bundle.target}:{bundle.variables[\'suffix\']} ${{bundle.name}}")')
    config = load_config(root, "dev", {"suffix": "flag"}, environ={})
    assert config.document["resources"]["jobs"]["j"]["description"] == "dev:flag ${bundle.name}"
    assert config.resolved["resources"]["jobs"]["j"]["description"] == "dev:flag tiny"
    # Each bundle root runs its own copy of a module, even under the same module name.
    other = _with_mutator(tmp_path / "other", 'replace(job, description="other")')
    assert load_config(other, "dev", environ={}).document["resources"]["jobs"]["j"]["description"] == "other"
    assert load_config(root, "dev", environ={}).document["resources"]["jobs"]["j"]["description"] == "dev:x ${bundle.name}"


@pytest.mark.parametrize(
    ("entry", "body", "message"),
    [
        ("resources.tweak", "job", r"'resources.tweak' is not module:function"),
        ("no_such_module:mutate", "job", r"cannot import no_such_module for no_such_module:mutate .*neither a file in .* nor installed"),
        ("resources.tweak:other", "job", r"resources.tweak has no other \(listed as resources.tweak:other\)"),
        ("resources.tweak:replace", "job", r"resources.tweak:replace is not a @job_mutator"),
        ("resources.tweak:mutate", "job.nope", r"resources/main.yml: resources.jobs.j: python mutator resources.tweak:mutate: .*nope"),
    ],
)
def test_a_broken_mutator_is_refused_naming_the_entry(tmp_path, entry, body, message):
    root = _with_mutator(tmp_path, body, entry)
    with pytest.raises(BundleError, match=message):
        load_config(root, "dev", environ={})


def _serverless_job(**task: Any) -> dict[str, Any]:
    environment = {"environment_key": "e", "spec": {"environment_version": "4", "dependencies": ["../dist/*.whl"]}}
    return {"name": "tiny", "environments": [environment], "tasks": [{"task_key": "a", "environment_key": "e", "notebook_task": {"notebook_path": "../notebooks/nb.ipynb"}, **task}]}


def _serverless_bundle(root: Path, job: dict[str, Any]) -> Path:
    return write_bundle(root, {"variables": {"compute": {"default": "serverless"}}, "targets": {"dev": {}}, "artifacts": {"w": {"type": "whl", "path": "."}}}, {"jobs": {"j": job}})


def test_a_well_formed_serverless_job_passes_and_cluster_rules_do_not_apply(tmp_path):
    assert _problems(_serverless_bundle(tmp_path, _serverless_job()), "dev", ALICE) == []
    # The same job under compute=cluster is not judged by the serverless rules (nor the other way round).
    assert _problems(_serverless_bundle(tmp_path, _job()), "dev", ALICE, compute="cluster") == []


def test_a_serverless_task_that_keeps_a_cluster_or_misses_the_wheel_is_caught(tmp_path):
    job = _serverless_job(
        new_cluster={"spark_version": "17.3.x-scala2.13", "spark_conf": {"spark.sql.session.timeZone": "UTC"}},
        libraries=[{"whl": "../dist/*.whl"}],
    )
    job["tasks"].append({"task_key": "b", "notebook_task": {"notebook_path": "../notebooks/nb.ipynb"}})
    job["environments"].append({"environment_key": "bare", "spec": {"environment_version": "4", "dependencies": ["pandas<3", "../gone/*.whl"]}})
    job["tasks"].append({"task_key": "c", "environment_key": "bare", "notebook_task": {"notebook_path": "../notebooks/nb.ipynb"}})
    messages = _problems(_serverless_bundle(tmp_path, job), "dev", ALICE)
    fix = "--var compute=serverless relies on the resources.compute:choose_compute mutator under python.mutators in databricks.yml"
    assert sorted(messages) == sorted([
        f"has new_cluster with compute=serverless, where a task runs on no cluster; {fix}",
        f"has libraries with compute=serverless, where a task runs on no cluster; {fix}",
        f"has no environment_key with compute=serverless, so the rulewatch wheel never reaches its notebook; {fix}",
        "library ../gone/*.whl is neither built by a whl artifact nor present",
    ])  # fmt: skip
    job["environments"][1]["spec"]["dependencies"] = ["pandas<3"]
    assert "environment bare lists no wheel (.whl) in spec.dependencies; the notebooks import rulewatch from it" in _problems(_serverless_bundle(tmp_path, job), "dev", ALICE)
