"""The bundle's compute switch: the ``compute`` variable puts every job on its job cluster or on serverless.

The jobs are written for a job cluster. A target override can add keys but never remove them, so
serverless cannot be a YAML variant of the same job; this ``databricks-bundles`` mutator (listed under
``python.mutators`` in databricks.yml) rewrites each job when ``compute`` is ``serverless``. The CLI runs
it at deploy time with the bundle root as working directory; ``rulewatch.bundle.config`` runs it the same
way for the offline checks and the local runner.

It lives beside the job files on purpose: the CLI may take a path the mutator writes as relative to this
file, while the job's own paths are relative to its YAML file; in one folder, ``../dist/*.whl`` means the
same either way.
"""

from __future__ import annotations

from dataclasses import replace

from databricks.bundles.core import Bundle, job_mutator
from databricks.bundles.jobs import Environment, Job, JobEnvironment

COMPUTES = ("cluster", "serverless")
ENVIRONMENT_KEY = "rulewatch"
# Serverless environment 4 is the one on Python 3.12 with Databricks Connect 17 (Spark 4), the line the
# job cluster's Databricks Runtime 17.3 floor stands for; the wheel needs Python 3.11 or newer.
ENVIRONMENT_VERSION = "4"


@job_mutator
def choose_compute(bundle: Bundle, job: Job) -> Job:
    compute = bundle.variables.get("compute")
    if compute == "cluster":
        return job
    if compute != "serverless":
        raise ValueError(f"variable compute is {compute!r}; set it to one of {', '.join(COMPUTES)} (e.g. --var compute=serverless)")
    wheels: list[str] = []
    for task in job.tasks:
        for library in task.libraries:
            if not isinstance(library.whl, str):
                # A serverless environment takes pip requirements only; anything else has no place to go.
                raise ValueError(f"task {task.task_key}: library {library.as_dict()} cannot move to a serverless environment; give it as a whl")
            if library.whl not in wheels:
                wheels.append(library.whl)
    environment = JobEnvironment(environment_key=ENVIRONMENT_KEY, spec=Environment(environment_version=ENVIRONMENT_VERSION, dependencies=wheels))
    tasks = [replace(task, job_cluster_key=None, libraries=[], environment_key=ENVIRONMENT_KEY) for task in job.tasks]
    return replace(job, job_clusters=[], environments=[environment], tasks=tasks)
