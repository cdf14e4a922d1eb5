"""Run the asset bundle's job DAG on this machine, one real notebook execution per task.

The job is read from the same ``databricks.yml`` + ``include``d YAML that ``databricks bundle
deploy`` ships, merged and resolved the way the CLI does it (``rulewatch.bundle.config``), so a local
run exercises the deployed task graph, parameters and notebooks rather than a hand-maintained copy of
them. Only what a local run needs is interpreted: ``${var.NAME}`` (bundle variables, nested ones
included), ``{{job.parameters.NAME}}`` (job parameters) and ``notebook_task`` tasks joined by
``depends_on``; anything else a task would need is reported instead of silently ignored.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from rulewatch.bundle import DEFAULT_JOB
from rulewatch.bundle.config import BundleError, Identity, load_config
from rulewatch.spark.storage.lakehouse import HOLDER_ENV, Lakehouse, exclusive
from rulewatch.spark.evaluator.settings import GoldSettings
from rulewatch.spark.runtime.env import repository_root
from rulewatch.spark.present.widgets import widget_env

Log = Callable[[str], None]

_OTHER_REF = re.compile(r"(?<!\$)\$\{[^}]*\}")
_DYNAMIC_REF = re.compile(r"\{\{\s*([^}]*?)\s*\}\}")
_JOB_PARAM = re.compile(r"job\.parameters\.([A-Za-z_][\w-]*)")

# A local run stands in for a bundle target: there is no Unity Catalog here, so catalog and schema are
# empty (the setup task then creates no catalog views), tables too (Delta folders under the lakehouse),
# and the lakehouse and landing paths come from the command line instead of the volumes derived from
# them. Gold's shards are the local default (one per stateful partition here; the bundle's 16 is for a
# cluster's cores), so a lakehouse begun by `rulewatch run` or the gold notebook resumes under a local job
# run and the other way round. --var still wins over these.
LOCAL_VARIABLES: dict[str, str] = {"catalog": "", "schema": "", "tables": "", "gold_shards": str(GoldSettings.shards)}


class JobError(Exception):
    """The bundle cannot be run as asked (bad reference, unknown job, cycle, ...)."""


class JobRunFailed(JobError):
    """At least one task failed; ``results`` holds every task's outcome, dependants as skipped."""

    def __init__(self, job_key: str, results: list[TaskResult]):
        self.results = results
        failed = [r for r in results if r.status == "failed"]
        skipped = [r.task_key for r in results if r.status == "skipped"]
        detail = "; ".join(f"task {r.task_key} failed: {r.error}" for r in failed)
        if skipped:
            detail += f"; skipped: {', '.join(skipped)}"
        super().__init__(f"job {job_key}: {detail}")


@dataclass(frozen=True)
class Task:
    key: str
    notebook: Path  # absolute; the YAML gives it relative to the file that declares the task
    base_parameters: dict[str, str]  # still holding {{job.parameters.*}} references
    depends_on: tuple[str, ...]
    timeout_seconds: int | None


@dataclass(frozen=True)
class JobSpec:
    key: str
    source: Path  # the YAML file the job came from, for error messages and relative paths
    definition: dict[str, Any]  # merged as the CLI merges it, before any reference is resolved
    parameters: dict[str, str]  # name -> default, with ${var.*} resolved
    tasks: tuple[Task, ...]


@dataclass(frozen=True)
class Bundle:
    root: Path
    variables: dict[str, Any]  # resolved values (a complex variable keeps its type)
    jobs: dict[str, JobSpec]
    files: tuple[Path, ...]  # databricks.yml first, then every included file
    target: str | None = None  # the bundle target applied; None for a local run

    def job(self, job_key: str | None) -> JobSpec:
        """The named job, or the only one when no name is given."""
        if job_key is None:
            if len(self.jobs) == 1:
                return next(iter(self.jobs.values()))
            if DEFAULT_JOB in self.jobs:
                return self.jobs[DEFAULT_JOB]
            raise JobError(f"bundle {self.root} defines {len(self.jobs)} jobs; name one of: {', '.join(sorted(self.jobs)) or '(none)'}")
        if job_key not in self.jobs:
            raise JobError(f"no job {job_key!r} in bundle {self.root}; jobs: {', '.join(sorted(self.jobs)) or '(none)'}")
        return self.jobs[job_key]


@dataclass
class TaskResult:
    task_key: str
    status: Literal["ok", "failed", "skipped"]
    seconds: float = 0.0
    error: str | None = None  # "<ename>: <evalue>" of the failing cell, or why it was skipped
    parameters: dict[str, str] = field(default_factory=dict)  # the widget values the notebook got
    notebook: Any = None  # the executed nbformat notebook (outputs included) when it ran
    warnings: tuple[str, ...] = ()  # the notebook's output lines that start with "WARNING:"


def find_bundle_root(start: Path | None = None) -> Path:
    """The nearest folder holding ``databricks.yml`` from ``start`` upwards, else this checkout's."""
    root = repository_root(start)
    if root is None:
        raise JobError(f"no databricks.yml in {(start or Path.cwd()).resolve()} or any parent folder")
    return root


def _text(value: Any) -> str:
    """A parameter value as Databricks passes it: text (a YAML number or boolean included)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse_job(key: str, definition: dict[str, Any], resolved: dict[str, Any], source: Path) -> JobSpec:
    parameters = {str(p["name"]): _text(p.get("default", "")) for p in resolved.get("parameters") or []}
    tasks: list[Task] = []
    for raw in resolved.get("tasks") or []:
        task_key = raw.get("task_key")
        if not task_key:
            raise JobError(f"{source}: job {key} has a task without task_key")
        if any(t.key == task_key for t in tasks):
            raise JobError(f"{source}: job {key} declares task {task_key} twice")
        notebook_task = raw.get("notebook_task")
        if notebook_task is None:
            kinds = ", ".join(k for k in raw if k.endswith("_task")) or "no task type"
            raise JobError(f"{source}: task {task_key} is {kinds}; only notebook_task runs locally")
        # Anything but the default would change which tasks run after a failure; not emulated.
        if raw.get("run_if", "ALL_SUCCESS") != "ALL_SUCCESS":
            raise JobError(f"{source}: task {task_key} has run_if {raw['run_if']}; only ALL_SUCCESS runs locally")
        tasks.append(
            Task(
                key=task_key,
                notebook=(source.parent / notebook_task["notebook_path"]).resolve(),
                base_parameters={str(k): _text(v) for k, v in (notebook_task.get("base_parameters") or {}).items()},
                depends_on=tuple(d["task_key"] for d in raw.get("depends_on") or []),
                timeout_seconds=raw.get("timeout_seconds") or None,
            )
        )
    return JobSpec(key, source, definition, parameters, tuple(tasks))


def load_bundle(
    root: Path | None = None,
    variables: Mapping[str, Any] | None = None,
    *,
    target: str | None = None,
    identity: Identity | None = None,
    environ: Mapping[str, str] | None = None,
) -> Bundle:
    """The bundle's jobs as the CLI would deploy them for ``target``, or as a local run sees them (None).

    ``variables`` are ``--var`` values. Without a target the local stand-ins in ``LOCAL_VARIABLES`` apply;
    ``identity`` resolves ``${workspace.current_user.*}`` (a target like dev needs one).
    """
    root = (root or find_bundle_root()).resolve()
    try:
        config = load_config(
            root,
            target,
            variables,
            identity=identity,
            environ=environ,
            target_defaults=LOCAL_VARIABLES if target is None else None,
        )
    except BundleError as err:
        raise JobError(str(err)) from err
    jobs: dict[str, JobSpec] = {}
    resolved_jobs = (config.resolved.get("resources") or {}).get("jobs") or {}
    for key, definition in ((config.document.get("resources") or {}).get("jobs") or {}).items():
        jobs[key] = _parse_job(key, definition, resolved_jobs[key], config.source_of("jobs", key))
    return Bundle(root, dict(config.variables), jobs, config.files, target)


def task_order(job: JobSpec) -> list[Task]:
    """Tasks in dependency order (declaration order among ready tasks); unknown deps and cycles raise."""
    by_key = {task.key: task for task in job.tasks}
    for task in job.tasks:
        for dep in task.depends_on:
            if dep not in by_key:
                raise JobError(f"{job.source}: task {task.key} depends on unknown task {dep}")
    ordered: list[Task] = []
    done: set[str] = set()
    while len(ordered) < len(job.tasks):
        ready = [t for t in job.tasks if t.key not in done and all(d in done for d in t.depends_on)]
        if not ready:
            stuck = ", ".join(t.key for t in job.tasks if t.key not in done)
            raise JobError(f"{job.source}: job {job.key} has a dependency cycle among tasks {stuck}")
        ordered.append(ready[0])
        done.add(ready[0].key)
    return ordered


def task_parameters(job: JobSpec, task: Task, overrides: dict[str, str]) -> dict[str, str]:
    """The task's widget values, as Databricks computes them for a notebook task.

    base_parameters with ``{{job.parameters.NAME}}`` filled in, then every job parameter on top:
    Databricks pushes job parameters down to each notebook task's widgets and they win over a
    task parameter of the same name.
    """
    values = {**job.parameters, **overrides}

    def substitute(match: re.Match[str]) -> str:
        reference = match.group(1)
        param = _JOB_PARAM.fullmatch(reference)
        if param is None:
            raise JobError(f"{job.source}: task {task.key} uses {{{{{reference}}}}}; only {{{{job.parameters.NAME}}}} resolves locally")
        if param.group(1) not in values:
            raise JobError(
                f"{job.source}: task {task.key} references unknown job parameter {param.group(1)} "
                f"(job {job.key} has: {', '.join(sorted(job.parameters)) or 'none'})"
            )
        return values[param.group(1)]

    resolved = {name: _DYNAMIC_REF.sub(substitute, value) for name, value in task.base_parameters.items()}
    params = {**resolved, **values}
    for name, value in params.items():
        # ${bundle.*}, ${workspace.*}, ... only mean something to a deployed bundle.
        if match := _OTHER_REF.search(value):
            raise JobError(f"{job.source}: task {task.key} parameter {name} uses {match.group(0)}; only ${{var.NAME}} resolves locally")
    return params


def notebook_client(nb: Any, **options: Any) -> Any:
    """An nbclient ``NotebookClient`` for ``nb`` that stops the kernel's heartbeat once the kernel is up,
    and talks to the kernel over Unix sockets in a private folder.

    nbclient tells a dead kernel by its process (the kernel manager), never by the heartbeat, whose
    thread can only hang the run: at the end nbclient shuts the kernel down before it stops that
    thread, and on a loaded machine the thread was seen waiting for ever inside its event loop, with
    the run waiting on it (jupyter_client's ``HBChannel.stop`` joining it; two test workers on two
    cores, the kernel's Spark stopping). Stopped while the kernel answers, it ends at once.

    Over TCP (the default) ipykernel warns on every start that its traffic is unencrypted, four times
    a job run. Its IPC transport's default socket path is relative, and the kernel runs in the
    notebook's folder, not the caller's: the sockets get an absolute path in a folder only this user reads.
    """
    from nbclient import NotebookClient

    class Client(NotebookClient):
        def create_kernel_manager(self) -> Any:
            km = super().create_kernel_manager()
            self.sockets = tempfile.TemporaryDirectory(prefix="rulewatch-kernel-")  # removed with the client
            km.transport = "ipc"
            km.ip = str(Path(self.sockets.name) / "kernel")
            return km

        async def async_start_new_kernel_client(self) -> Any:
            client = await super().async_start_new_kernel_client()
            client.hb_channel.stop()
            return client

    return Client(nb, **options)


# Run in the shared kernel before each notebook: an empty namespace, the notebook's widget values
# (RULEWATCH_WIDGET_*, nothing left from the task before) and its working directory.
_PRELUDE = """\
get_ipython().run_line_magic("reset", "-f")
import os as _rulewatch_os
[_rulewatch_os.environ.pop(name) for name in list(_rulewatch_os.environ) if name.startswith("RULEWATCH_WIDGET_")]
_rulewatch_os.environ.update({widgets!r})
_rulewatch_os.chdir({cwd!r})
del _rulewatch_os
"""


class SharedKernel:
    """Notebooks run one after another in one python3 kernel, started at the first and shut down at the end.

    Each notebook starts with an empty namespace, its own widget values and working directory. What
    stays is the process: imported modules, environment changes, the SparkSession with its settings
    and temporary views, and the JVM (whose working directory is the first notebook's). So a local job
    run of four tasks starts one JVM, not four, and each task after the first finds Spark warm, as the
    tasks of one Databricks job share their cluster's Spark (there each notebook also gets a Python
    process and SparkSession of its own: a task must not lean on what an earlier one left). A kernel
    that died, timed out or could not be prepared is replaced for the next notebook.
    """

    def __init__(self, cwd: Path | str) -> None:
        self.cwd = str(cwd)
        self._client: Any = None
        self._kernel: Any = None  # the client's setup_kernel context, entered

    def __enter__(self) -> SharedKernel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._kernel is not None:
            kernel, self._kernel, self._client = self._kernel, None, None
            kernel.__exit__(None, None, None)

    def _started(self, nb: Any, timeout: int | None) -> Any:
        if self._kernel is None:
            # RULEWATCH_WIDGET_* left in the caller's shell are dropped by each notebook's prelude, before it runs.
            client = notebook_client(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": self.cwd}})
            kernel = client.setup_kernel(cwd=self.cwd)
            kernel.__enter__()  # a kernel that fails to start raises here, and the next notebook tries again
            self._client, self._kernel = client, kernel
        return self._client

    def run(self, nb: Any, widgets: Mapping[str, str], timeout: int | None = None, cwd: Path | str | None = None) -> None:
        """Execute every cell of ``nb`` in place (outputs kept in it); a cell's error raises nbclient's
        ``CellExecutionError``. ``timeout``: seconds per cell (None: none); ``cwd``: default the kernel's."""
        import nbformat
        from nbclient.exceptions import CellExecutionError

        client = self._started(nb, timeout)
        client.nb, client.timeout = nb, timeout
        client.reset_execution_trackers()
        prelude = nbformat.v4.new_code_cell(_PRELUDE.format(widgets=dict(widget_env(widgets)), cwd=str(cwd or self.cwd)))
        try:
            # Through nbclient like any cell (its timeout, a dead kernel noticed), but into no notebook's outputs.
            reply = client.wait_for_reply(client.kc.execute(prelude.source, silent=True, store_history=False), prelude)
            if reply is None or reply["content"]["status"] != "ok":
                content = reply["content"] if reply else {"status": "no reply"}
                raise RuntimeError(f"the kernel could not be prepared for the notebook ({content['status']}): {content.get('ename')}: {content.get('evalue')}")
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
        except CellExecutionError:  # the notebook's own error: the kernel is fine for the next one
            raise
        except Exception:  # gone, stuck or unprepared: the next notebook gets a new kernel
            self.close()
            raise


def _execute_notebook(task: Task, params: dict[str, str], kernel: SharedKernel) -> tuple[Any, str | None]:
    """Run the task's notebook in the job run's kernel; return it with outputs and the error, if any."""
    try:
        import nbformat
        from nbclient.exceptions import CellExecutionError
    except ImportError as err:
        raise JobError(f"local job runs need nbformat, nbclient and ipykernel: pip install 'rulewatch[dev]' ({err})") from err

    try:
        nb = nbformat.read(task.notebook, as_version=4)
    except (OSError, ValueError) as err:
        return None, f"{type(err).__name__}: cannot read notebook {task.notebook}: {err}"
    try:
        # The per-cell timeout is the task's whole timeout: the closest nbclient has; none, as on Databricks.
        kernel.run(nb, params, task.timeout_seconds)
    except CellExecutionError as err:
        return nb, f"{err.ename}: {err.evalue}"
    except Exception as err:  # dead kernel, timeout: still one task's failure, not the runner's
        return nb, f"{type(err).__name__}: {err}"
    return nb, None


def notebook_warnings(nb: Any) -> tuple[str, ...]:
    """The lines of an executed notebook's output that start with ``WARNING:`` (e.g. the summary's
    no-active-rule warning): a task can succeed and still have something the user must see."""
    texts = []
    for cell in nb.cells if nb is not None else ():
        for output in cell.get("outputs", ()):
            text = output.get("text") if output.get("output_type") == "stream" else output.get("data", {}).get("text/plain")
            texts.append("".join(text) if isinstance(text, list) else text or "")
    return tuple(line.strip() for text in texts for line in text.splitlines() if line.strip().startswith("WARNING:"))


def run_job_locally(
    job_key: str | None,
    overrides: dict[str, str],
    log: Log = print,
    *,
    root: Path | None = None,
    variables: dict[str, str] | None = None,
) -> list[TaskResult]:
    """Run every task of the bundle job in dependency order; raise ``JobRunFailed`` if any failed.

    ``overrides`` set job parameters (``lakehouse``, ``landing``, ...), ``variables`` bundle
    variables; ``root`` is the bundle folder (default: found from the current directory).
    """
    bundle = load_bundle(root, variables)
    job = bundle.job(job_key)
    unknown = sorted(set(overrides) - set(job.parameters))
    if unknown:
        raise JobError(f"{job.source}: job {job.key} has no parameter {', '.join(unknown)} (has: {', '.join(sorted(job.parameters)) or 'none'})")
    order = task_order(job)
    # Resolve every task's parameters before running anything: a bad reference fails fast, not at task 4.
    params = {task.key: task_parameters(job, task, overrides) for task in order}
    shown = ", ".join(f"{k}={v}" for k, v in {**job.parameters, **overrides}.items())
    log(f"job {job.key}: {len(order)} tasks ({' -> '.join(t.key for t in order)}); {shown}")

    results: dict[str, TaskResult] = {}
    with SharedKernel(bundle.root) as kernel:
        for n, task in enumerate(order, 1):
            prefix = f"[{n}/{len(order)}] {task.key} ..."
            blocked = [d for d in task.depends_on if results[d].status != "ok"]
            if blocked:
                results[task.key] = TaskResult(task.key, "skipped", error=f"upstream {', '.join(blocked)} did not succeed")
                log(f"{prefix} skipped (upstream {', '.join(blocked)} did not succeed)")
                continue
            started = time.monotonic()
            nb, error = _execute_notebook(task, params[task.key], kernel)
            seconds = time.monotonic() - started
            status: Literal["ok", "failed"] = "ok" if error is None else "failed"
            warnings = notebook_warnings(nb)
            results[task.key] = TaskResult(task.key, status, seconds, error, params[task.key], nb, warnings)
            log(f"{prefix} {status} ({seconds:.1f}s)" if error is None else f"{prefix} FAILED ({seconds:.1f}s): {error}")
            for warning in warnings:
                log(f"    {warning}")

    outcome = [results[task.key] for task in order]
    if any(r.status != "ok" for r in outcome):
        raise JobRunFailed(job.key, outcome)
    return outcome


@contextmanager
def _named_holder() -> Iterator[None]:
    """The kernels started meanwhile inherit this process as their lakehouse's holder (``lakehouse.HOLDER_ENV``):
    their notebooks' layers run under its hold, where any other process's are refused."""
    before = os.environ.get(HOLDER_ENV)
    os.environ[HOLDER_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOLDER_ENV, None)
        else:
            os.environ[HOLDER_ENV] = before


def cmd_job_run(args: argparse.Namespace) -> int:
    if args.target != "local":
        print(
            f"rulewatch: job run only runs --target local; run on Databricks with "
            f"`databricks bundle deploy -t {args.target}` then `databricks bundle run -t {args.target}{' ' + args.job if args.job else ''}`",
            file=sys.stderr,
        )
        return 2
    if args.lakehouse is None:
        print("rulewatch: job run --target local needs --lakehouse DIR (where the Delta tables go)", file=sys.stderr)
        return 2
    try:
        bundle = load_bundle(None, dict(args.var))
        job = bundle.job(args.job)
        # Paths given on the command line are relative to where it is typed; the kernels run in the bundle root.
        given = {
            "lakehouse": args.lakehouse,
            "landing": args.landing,
            "rules_file": args.rules,
        }
        defaults = {
            "landing": str(bundle.root / "fixtures" / "transactions"),
            "rules_file": str(bundle.root / "fixtures" / "rules.json"),
        }
        overrides = {k: v for k, v in defaults.items() if k in job.parameters}
        # An empty value stays empty: --rules "" means "leave config/rules as it is".
        overrides.update({k: os.path.abspath(v) if v else v for k, v in given.items() if v is not None})
        overrides.update(dict(args.param))
        # The same lock as `rulewatch run` and live mode: the tasks write the same checkpoints.
        with exclusive(Lakehouse(args.lakehouse), f"rulewatch job run {job.key}"), _named_holder():
            results = run_job_locally(job.key, overrides, root=bundle.root, variables=dict(args.var))
    except JobRunFailed as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 1
    except JobError as err:  # the bundle or the command line is wrong: nothing ran
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    # Repeated as the last lines: "ok" on every task must not hide that nothing could alert.
    for result in results:
        for warning in result.warnings:
            print(f"rulewatch: task {result.task_key}: {warning}", file=sys.stderr)
    return 0
