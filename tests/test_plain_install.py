"""The command line on a plain install: without Spark, Delta and pyarrow (a laptop that only talks to a
workspace) or without an extra's packages, every command still parses, and one that needs a missing
package says which extra to install instead of ending in an ImportError."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT

# Runs rulewatch.cli.main with the named top-level packages unimportable, as if they were not installed: a
# meta-path finder ahead of every other raises what a missing package raises.
BLOCKED_RUN = """
import sys
blocked = set(sys.argv[1].split(","))
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.argv = ["rulewatch", *sys.argv[2:]]
from rulewatch.cli.main import main
try:
    code = main()
except SystemExit as end:  # --help, --version and parser errors
    code = end.code
imported = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
assert not imported, imported
sys.exit(code)
"""
HEAVY = "pyspark,delta,pyarrow"


def rulewatch(blocked: str, *argv: str, home=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATABRICKS_")}
    env["PYTHONPATH"] = str(ROOT / "src")  # this checkout, whatever the venv's editable install points at
    if home:
        env["HOME"] = str(home)  # no ~/.databrickscfg either
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, blocked, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_blocking_works():
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN.replace("from rulewatch.cli", "import pyspark\nfrom rulewatch.cli"), HEAVY, "--version"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'pyspark'" in done.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["remote", "--help"], ["remote", "run", "--help"], ["run", "--help"], ["stream", "--help"]])
def test_help_and_version_need_no_spark(argv):
    done = rulewatch(HEAVY, *argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rulewatch ") if argv == ["--version"] else done.stdout.startswith("usage: rulewatch")


@pytest.mark.parametrize("command", ["run", "alerts"])
def test_a_remote_command_without_credentials_says_what_to_set(tmp_path, command):
    argv = ["remote", "run", "--no-follow"] if command == "run" else ["remote", "alerts", "--warehouse-id", "abc"]
    done = rulewatch(HEAVY, *argv, home=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("rulewatch: no usable Databricks configuration") and "DATABRICKS_HOST" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_spark_command_without_spark_names_the_extra(tmp_path):
    done = rulewatch(HEAVY, "run", "--lakehouse", str(tmp_path / "lh"), "--landing", str(FIXTURES / "transactions"))
    assert done.returncode == 2
    assert done.stderr == "rulewatch: this command needs the pyspark module, which is not installed: pip install 'rulewatch[local]'\n"


def test_a_remote_command_without_the_sdk_names_the_extra(tmp_path):
    done = rulewatch(f"{HEAVY},databricks", "remote", "run", home=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "rulewatch: this command needs the databricks module, which is not installed: pip install 'rulewatch[remote]'\n"


def test_the_local_job_runner_without_pyyaml_names_the_extra(tmp_path):
    done = rulewatch(f"{HEAVY},yaml", "job", "run", "--lakehouse", str(tmp_path / "lh"))
    assert done.returncode == 2
    assert done.stderr == "rulewatch: this command needs the yaml module, which is not installed: pip install 'rulewatch[local]'\n"
    assert not (tmp_path / "lh").exists()


def test_the_jobs_notebooks_need_neither_pyyaml_nor_databricks_sdk():
    """The wheel on the cluster installs neither (they are the `local` and `remote` extras): every
    rulewatch module the notebooks import must load without them (off Databricks, where widgets and
    secret scopes would use the runtime's own databricks-sdk)."""
    modules = sorted({m for nb in (ROOT / "notebooks").glob("*.ipynb") for m in re.findall(r"(?:from|import) (rulewatch[\w.]*)", nb.read_text())})
    assert "rulewatch.spark.layers.pipeline" in modules
    code = BLOCKED_RUN.split("sys.argv = ")[0] + "import importlib\nfor m in sys.argv[2:]: importlib.import_module(m)\n"
    done = subprocess.run([sys.executable, "-c", code, "yaml,databricks", *modules], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
