"""Offline checks of the asset bundle: what ``databricks bundle validate -t TARGET`` would reject.

The CLI cannot run here, so its checks are redone in two parts:

- ``schema_problems``: a target's merged configuration (``rulewatch.bundle.config``) against the CLI's own
  JSON schema (``databricks bundle schema``; a copy lives in ``../shared/databricks/``). Its ``pattern``
  keywords use ``\\p{L}``-style classes that Python's ``re`` lacks, so patterns run on the ``regex`` package.
- ``rule_problems``: rules the CLI enforces in code, which a schema cannot express (production mode
  needs ``run_as`` or a service principal, a dashboard needs a warehouse, a task's notebook must exist,
  ...), plus this project's own: job clusters run a runtime the gold layer works on, with
  ``compute=serverless`` no task keeps a cluster and each gets the wheel from its job environment, and
  ``isolation_problems`` proves that no two targets share a catalog and schema, a volume or a checkpoint
  folder.

``check_bundle`` runs all of them for every target.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rulewatch.bundle.config import (
    REFERENCE,
    BundleConfig,
    BundleError,
    Identity,
    Lookup,
    bundle_files,
    load_config,
    read_yaml,
    references_in,
    target_names,
)
from rulewatch.spark.storage.lakehouse import Lakehouse

# The first CLI with dataset_catalog / dataset_schema on dashboards (databricks/cli pull request 4130).
DASHBOARD_DATASET_DEFAULTS_CLI = (0, 281, 0)

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
# The oldest Databricks Runtime a job cluster may run: 17.3 LTS is the first on Spark 4.0 (the oldest
# Spark line the tests run on, `make test-spark40`) with RocksDB as the default state store, which
# transformWithStateInPandas needs (it exists from 16.2, on Spark 3.5 with Databricks' additions).
MIN_RUNTIME = (17, 3)
_RUNTIME = re.compile(r"(\d+)\.(\d+)\.x-")


@dataclass(frozen=True)
class Problem:
    target: str | None  # None: a problem of the files themselves, whatever the target
    where: str  # file and key path, or the resource
    message: str

    def __str__(self) -> str:
        return f"[{self.target or 'all targets'}] {self.where}: {self.message}"


# ---- the CLI's JSON schema ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> Any:
    import regex

    return regex.compile(pattern)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Mapping[str, Any]) -> Iterator[Any]:
    """JSON Schema ``pattern`` with ECMAScript/Go classes such as ``\\p{L}`` (as the schema's authors meant)."""
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.lru_cache(maxsize=4)
def _validator_for(schema_text: str) -> Any:
    try:
        import jsonschema
        import regex
    except ImportError as err:
        raise BundleError(f"the schema check needs jsonschema and regex: pip install 'rulewatch[dev]' ({err})") from err

    schema = json.loads(schema_text)
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    # The schema must itself be a valid schema (a truncated or wrong file must not pass everything);
    # its metaschema's "regex" format is checked with the same engine as the patterns.
    formats = jsonschema.FormatChecker()
    formats.checks("regex", raises=regex.error)(lambda pattern: bool(regex.compile(pattern)))
    meta = jsonschema.validators.validator_for(base.META_SCHEMA)(base.META_SCHEMA, format_checker=formats)
    error = jsonschema.exceptions.best_match(meta.iter_errors(schema))
    if error is not None:
        raise BundleError(f"the bundle JSON schema is not a valid JSON schema: {error.message}")
    return jsonschema.validators.extend(base, {"pattern": _pattern})(schema)


def load_schema(path: Path) -> str:
    """The schema's text (kept as text so the compiled validator can be cached by it)."""
    try:
        text = path.read_text()
        json.loads(text)
    except (OSError, ValueError) as err:
        raise BundleError(f"cannot read the bundle JSON schema {path}: {err}") from err
    return text


def _leaves(error: Any) -> Iterator[Any]:
    """The errors that say what is wrong, under the schema's ``oneOf``/``anyOf`` alternatives.

    Nearly every node of the CLI's schema is oneOf(the real shape, a ``${...}`` reference string). A value
    that is not a reference string was meant as the real shape, so the alternatives' complaints "does not
    match the reference pattern" and "is not a string" are dropped and the real shape's errors followed down.
    """
    if error.validator in ("oneOf", "anyOf") and error.context:
        meant = [e for e in error.context if e.validator != "pattern" and not (e.validator == "type" and e.validator_value == "string")]
        if meant:
            for sub in meant:
                yield from _leaves(sub)
            return
    yield error


def _describe(error: Any) -> str:
    path = "/".join(map(str, error.absolute_path)) or "(top level)"
    return f"{path}: {error.message}"


def schema_problems(document: Mapping[str, Any], schema_text: str) -> list[str]:
    """Every way ``document`` breaks the CLI's JSON schema, one line each (empty when it conforms)."""
    validator = _validator_for(schema_text)
    return sorted({_describe(leaf) for error in validator.iter_errors(dict(document)) for leaf in _leaves(error)})


# ---- rules the CLI enforces in code -------------------------------------------------------------------


def _version(text: str) -> tuple[int, int, int] | None:
    match = _VERSION.search(text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def cli_version_floor(constraint: str) -> tuple[int, int, int] | None:
    """The lowest CLI version ``bundle.databricks_cli_version`` admits (``">= 0.281.0, < 1.0.0"`` -> 0.281.0)."""
    floors: list[tuple[int, int, int]] = []
    for part in constraint.split(","):
        part = part.strip()
        version = _version(part)
        if version is None:
            continue
        if part.startswith(">=") or part[0].isdigit() or part.startswith("v") or part.startswith("="):
            floors.append(version)
        elif part.startswith(">"):
            floors.append((version[0], version[1], version[2] + 1))
    return max(floors) if floors else None


def _is_deferred(value: Any) -> bool:
    """A value only a deploy can know: a reference left as written (a lookup, ${resources...})."""
    return isinstance(value, str) and REFERENCE.fullmatch(value) is not None


def _identity_matches(entry: Mapping[str, Any], identity: Identity) -> bool:
    return identity.user_name in (entry.get("user_name"), entry.get("service_principal_name"))


def _run_as_problems(config: BundleConfig, where: str) -> list[Problem]:
    problems: list[Problem] = []
    jobs = (config.resolved.get("resources") or {}).get("jobs") or {}
    top = config.resolved.get("run_as")
    for key, job in jobs.items():
        run_as = job.get("run_as") or top
        if run_as is None:
            continue
        named = [k for k in ("user_name", "service_principal_name", "group_name") if isinstance(run_as.get(k), str) and run_as[k].strip()]
        if len(named) != 1:
            problems.append(
                Problem(config.target, f"{where}: run_as of job {key}", f"must name exactly one identity (user_name or service_principal_name), got {named or 'none'}")
            )
    if config.mode == "production":
        identity = config.identity
        if not (identity and identity.is_service_principal) and any(not (job.get("run_as") or top) for job in jobs.values()):
            problems.append(Problem(config.target, where, "'run_as' must be set for all jobs when using 'mode: production' (or deploy as a service principal)"))
    return problems


def _permission_problems(config: BundleConfig, where: str) -> list[Problem]:
    identity = config.identity
    permissions = config.resolved.get("permissions") or []
    if config.mode != "production" or identity is None or not permissions:
        return []
    if any(_identity_matches(p, identity) and p.get("level") == "CAN_MANAGE" for p in permissions):
        return []
    kind = "service_principal_name" if identity.is_service_principal else "user_name"
    return [
        Problem(
            config.target,
            f"{where}: permissions",
            f"must give the deploying identity {identity.user_name!r} CAN_MANAGE ({kind}: {identity.user_name}); "
            "otherwise its rights on the job and deployment folder hold only while it is the one deploying",
        )
    ]


def _workspace_path_problems(config: BundleConfig, where: str) -> list[Problem]:
    if config.mode != "development" or config.identity is None:
        return []
    workspace = config.resolved.get("workspace") or {}
    return [
        Problem(config.target, f"{where}: workspace.{key}", "must start with '~/' or contain the current username when using 'mode: development'")
        for key in ("root_path", "state_path", "file_path", "artifact_path")
        if isinstance(workspace.get(key), str)
        and not workspace[key].startswith("~/")
        and config.identity.user_name not in workspace[key]
    ]


def _dashboard_problems(config: BundleConfig) -> list[Problem]:
    problems: list[Problem] = []
    dashboards = (config.resolved.get("resources") or {}).get("dashboards") or {}
    constraint = (config.resolved.get("bundle") or {}).get("databricks_cli_version")
    floor = cli_version_floor(str(constraint)) if constraint else None
    for key, dashboard in dashboards.items():
        source = config.source_of("dashboards", key)
        where = f"{source}: resources.dashboards.{key}"
        warehouse = dashboard.get("warehouse_id")
        if not (isinstance(warehouse, str) and warehouse.strip()):
            problems.append(Problem(config.target, where, "warehouse_id is required (give an id, or a variable with a warehouse lookup)"))
        file_path = dashboard.get("file_path")
        if file_path and not (source.parent / str(file_path)).is_file():
            problems.append(Problem(config.target, where, f"file_path {file_path} does not exist next to {source.name}"))
        if ("dataset_catalog" in dashboard or "dataset_schema" in dashboard) and (floor is None or floor < DASHBOARD_DATASET_DEFAULTS_CLI):
            needed = ".".join(map(str, DASHBOARD_DATASET_DEFAULTS_CLI))
            problems.append(
                Problem(
                    config.target,
                    where,
                    f"dataset_catalog/dataset_schema need CLI {needed} or newer: set bundle.databricks_cli_version to \">= {needed}\" "
                    f"(it is {constraint!r}); an older CLI drops them",
                )
            )
    return problems


def _job_problems(config: BundleConfig) -> list[Problem]:
    problems: list[Problem] = []
    artifacts = config.resolved.get("artifacts") or {}
    wheel_dirs = {(config.root / str(a.get("path", "."))).resolve() / "dist" for a in artifacts.values() if isinstance(a, dict) and a.get("type") == "whl"}
    for key, job in ((config.resolved.get("resources") or {}).get("jobs") or {}).items():
        source = config.source_of("jobs", key)
        where = f"{source}: resources.jobs.{key}"
        clusters = {c.get("job_cluster_key") for c in job.get("job_clusters") or []}
        environments = {e.get("environment_key") for e in job.get("environments") or []}
        tasks = job.get("tasks") or []
        keys = [t.get("task_key") for t in tasks]
        problems += _continuous_problems(config.target, where, job)
        for duplicate in sorted({k for k in keys if keys.count(k) > 1}):
            problems.append(Problem(config.target, where, f"task_key {duplicate} is used twice"))
        for cluster in job.get("job_clusters") or []:
            problems += _runtime_problems(config.target, f"{where}.job_clusters[{cluster.get('job_cluster_key')}]", cluster.get("new_cluster") or {})
        for task in tasks:
            here = f"{where}.tasks[{task.get('task_key')}]"
            for dep in task.get("depends_on") or []:
                if dep.get("task_key") not in keys:
                    problems.append(Problem(config.target, here, f"depends on unknown task {dep.get('task_key')}"))
            if task.get("job_cluster_key") and task["job_cluster_key"] not in clusters:
                problems.append(Problem(config.target, here, f"job_cluster_key {task['job_cluster_key']} is not in job_clusters"))
            if task.get("environment_key") and task["environment_key"] not in environments:
                problems.append(Problem(config.target, here, f"environment_key {task['environment_key']} is not in environments"))
            for kind, field_name in (("notebook_task", "notebook_path"), ("spark_python_task", "python_file")):
                path = (task.get(kind) or {}).get(field_name)
                if isinstance(path, str) and not path.startswith("/") and not _is_deferred(path):
                    if not (source.parent / path).is_file():
                        problems.append(Problem(config.target, here, f"{kind}.{field_name} {path} does not exist (relative to {source.name})"))
            for library in task.get("libraries") or []:
                wheel = library.get("whl") if isinstance(library, dict) else None
                if isinstance(wheel, str):
                    problems += _local_library_problems(config.target, here, source, wheel, wheel_dirs)
        for environment in job.get("environments") or []:
            here = f"{where}.environments[{environment.get('environment_key')}]"
            for dependency in (environment.get("spec") or {}).get("dependencies") or []:
                # A pip requirement ("pandas==2.2") is the environment's business; a relative path is a file of ours.
                if isinstance(dependency, str) and dependency.startswith(("./", "../")):
                    problems += _local_library_problems(config.target, here, source, dependency, wheel_dirs)
        if config.variables.get("compute") == "serverless":
            problems += _serverless_problems(config.target, where, job)
    return problems


def _local_library_problems(target: str, where: str, source: Path, library: str, wheel_dirs: set[Path]) -> list[Problem]:
    """A library path relative to ``source`` that no whl artifact builds and no file matches."""
    if library.startswith("/"):
        return []
    folder = (source.parent / library).parent
    if folder.resolve() in wheel_dirs or any(folder.glob(Path(library).name)):
        return []
    return [Problem(target, where, f"library {library} is neither built by a whl artifact nor present")]


# What a serverless task cannot carry: it runs on no cluster of the job's, so it has no cluster, no
# cluster libraries and no spark_conf (which only a cluster spec holds).
_CLUSTER_TASK_KEYS = ("job_cluster_key", "new_cluster", "existing_cluster_id", "libraries")
_COMPUTE_FIX = "--var compute=serverless relies on the resources.compute:choose_compute mutator under python.mutators in databricks.yml"


def _serverless_problems(target: str, where: str, job: Mapping[str, Any]) -> list[Problem]:
    """A job that ``compute=serverless`` left on a cluster, or whose tasks cannot reach the wheel.

    The notebooks import rulewatch, and on serverless the wheel reaches them only as a dependency of the
    job environment each task names; the job cluster's runtime pin has nothing to apply to there.
    """
    problems = []
    if job.get("job_clusters"):
        problems.append(Problem(target, where, f"has job_clusters with compute=serverless; {_COMPUTE_FIX}"))
    wheels = {
        e.get("environment_key"): [d for d in (e.get("spec") or {}).get("dependencies") or [] if isinstance(d, str) and d.endswith(".whl")]
        for e in job.get("environments") or []
    }
    for task in job.get("tasks") or []:
        here = f"{where}.tasks[{task.get('task_key')}]"
        for key in _CLUSTER_TASK_KEYS:
            if task.get(key):
                problems.append(Problem(target, here, f"has {key} with compute=serverless, where a task runs on no cluster; {_COMPUTE_FIX}"))
        key = task.get("environment_key")
        if not key:
            problems.append(Problem(target, here, f"has no environment_key with compute=serverless, so the rulewatch wheel never reaches its notebook; {_COMPUTE_FIX}"))
        elif key in wheels and not wheels[key]:
            problems.append(Problem(target, here, f"environment {key} lists no wheel (.whl) in spec.dependencies; the notebooks import rulewatch from it"))
    return problems


def _runtime_problems(target: str, where: str, cluster: Mapping[str, Any]) -> list[Problem]:
    """A job cluster on a Databricks Runtime older than ``MIN_RUNTIME`` (or one that is not a runtime version)."""
    version = cluster.get("spark_version")
    if not isinstance(version, str) or _is_deferred(version):
        return []
    found = _RUNTIME.match(version)
    if found and (int(found[1]), int(found[2])) >= MIN_RUNTIME:
        return []
    floor = ".".join(map(str, MIN_RUNTIME))
    return [Problem(target, where, f"spark_version {version} is not Databricks Runtime {floor} or newer (e.g. {floor}.x-scala2.13), which the gold layer needs")]


def _continuous_problems(target: str, where: str, job: Mapping[str, Any]) -> list[Problem]:
    """What the Jobs service refuses in a continuous job: a schedule beside it, task dependencies, and
    task retries unless ``task_retry_mode`` is ``ON_FAILURE``."""
    continuous = job.get("continuous")
    if not isinstance(continuous, Mapping):
        return []
    problems = []
    for other in ("schedule", "trigger"):
        if job.get(other):
            problems.append(Problem(target, where, f"a continuous job cannot also have a {other}"))
    retries = continuous.get("task_retry_mode") == "ON_FAILURE"
    for task in job.get("tasks") or []:
        here = f"{where}.tasks[{task.get('task_key')}]"
        if task.get("depends_on"):
            problems.append(Problem(target, here, "a continuous job's tasks cannot depend on each other"))
        if task.get("max_retries") and not retries:
            problems.append(Problem(target, here, "max_retries in a continuous job needs continuous.task_retry_mode ON_FAILURE"))
    return problems


def rule_problems(config: BundleConfig) -> list[Problem]:
    """The CLI's code-level rules for one resolved target (see the module docstring)."""
    where = str(config.root / "databricks.yml")
    return [
        *_run_as_problems(config, where),
        *_permission_problems(config, where),
        *_workspace_path_problems(config, where),
        *_dashboard_problems(config),
        *_job_problems(config),
    ]


def undefined_references(root: Path) -> list[Problem]:
    """``${var.NAME}`` references, in any file and any target, to a variable that is not declared."""
    contents = {path: read_yaml(path) for path in bundle_files(root)}
    declared: set[str] = set()
    for content in contents.values():
        declared |= set((content.get("variables") or {}).keys())
    problems = []
    for path, content in contents.items():
        for reference in references_in(content):
            parts = reference.split(".")
            name = parts[1] if parts[0] == "var" else parts[1] if parts[0] == "variables" and len(parts) > 1 else None
            if name is not None and name not in declared:
                problems.append(Problem(None, str(path), f"${{{reference}}} refers to undeclared variable {name}"))
    return problems


# ---- this project's rule: targets never share data -------------------------------------------------------


def _text_variable(config: BundleConfig, name: str) -> str:
    value = config.variables.get(name)
    return value if isinstance(value, str) else ""


def isolation_problems(configs: Mapping[str, BundleConfig]) -> list[Problem]:
    """Each target writes only inside its own catalog.schema, and no two targets share a place to write.

    The lakehouse (the checkpoints under ``<lakehouse>/_checkpoints``, and the tables when ``tables`` is
    empty) and the landing folder must be volumes of the target's own schema, and ``tables`` (the
    schema of the managed tables) that schema itself; catalog.schema, both volumes and the checkpoint
    folder must differ between every two targets.
    """
    problems: list[Problem] = []
    places: dict[str, dict[str, str]] = {}
    for target, config in configs.items():
        catalog, schema = _text_variable(config, "catalog"), _text_variable(config, "schema")
        if not (catalog and schema) or "${" in catalog + schema:
            problems.append(Problem(target, "variables", f"catalog and schema must be set to plain names, got {catalog!r}.{schema!r}"))
            continue
        home = f"/Volumes/{catalog}/{schema}/"
        lakehouse, landing = _text_variable(config, "lakehouse"), _text_variable(config, "landing")
        for name, path in (("lakehouse", lakehouse), ("landing", landing)):
            if not path.startswith(home):
                problems.append(Problem(target, f"variables.{name}", f"{path!r} is not a volume of the target's own schema {catalog}.{schema} ({home}...)"))
        tables = _text_variable(config, "tables")
        if tables not in ("", f"{catalog}.{schema}"):
            problems.append(Problem(target, "variables.tables", f"{tables!r} is not the target's own schema {catalog}.{schema} (or empty)"))
        places[target] = {
            "catalog.schema": f"{catalog}.{schema}",
            "lakehouse volume": lakehouse,
            "landing volume": landing,
            "checkpoints": Lakehouse(lakehouse).checkpoint("") if lakehouse else "",
        }
    names = sorted(places)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            for what, place in places[first].items():
                if place and place == places[second][what]:
                    problems.append(Problem(f"{first}+{second}", what, f"both targets use {place}"))
    return problems


# ---- all of it --------------------------------------------------------------------------------------------


def check_target(
    root: Path,
    target: str,
    schema_text: str | None,
    *,
    variables: Mapping[str, Any] | None = None,
    identity: Identity | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[BundleConfig | None, list[Problem]]:
    """One target: loaded strictly (every variable needs a value), schema-checked, rule-checked."""
    try:
        config = load_config(root, target, variables, identity=identity, environ=environ, strict=True)
    except BundleError as err:
        return None, [Problem(target, "configuration", str(err))]
    problems = [Problem(target, "schema (merged configuration)", line) for line in schema_problems(config.document, schema_text)] if schema_text else []
    problems += rule_problems(config)
    if any(isinstance(v, Lookup) and not str(v.name).strip() for v in config.variables.values()):
        problems.append(Problem(target, "variables", "a lookup names no object"))
    return config, problems


def check_bundle(
    root: Path,
    schema_text: str | None,
    *,
    variables: Mapping[str, Mapping[str, Any]] | None = None,
    identities: Mapping[str, Identity] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Problem]:
    """Every check for every target. ``variables``/``identities`` give per-target ``--var`` values and deployers."""
    root = root.resolve()
    problems = undefined_references(root)
    if schema_text:
        for path in bundle_files(root):
            problems += [Problem(None, f"{path} (as written)", line) for line in schema_problems(read_yaml(path), schema_text)]
    configs: dict[str, BundleConfig] = {}
    for target in target_names(root):
        config, found = check_target(
            root,
            target,
            schema_text,
            variables=(variables or {}).get(target),
            identity=(identities or {}).get(target),
            environ=environ,
        )
        problems += found
        if config is not None:
            configs[target] = config
    return problems + isolation_problems(configs)
