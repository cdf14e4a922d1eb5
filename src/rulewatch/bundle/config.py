"""The asset bundle's configuration as the Databricks CLI builds it, without a workspace.

``databricks bundle validate -t TARGET`` loads ``databricks.yml``, merges every ``include``d file into it,
applies the target's overrides, gives every variable its value and then resolves ``${...}`` references.
This module does the same offline, following the CLI's own rules (databricks/cli ``bundle/config/root.go``
``MergeTargetOverrides``, ``mutator/set_variables.go``, ``mutator/resolve_variable_references.go``), so the
local job runner and the bundle checks see the configuration a deploy would see:

- includes: each included file is merged into the root; a resource key defined twice is an error;
- a target: ``bundle``, ``workspace``, ``artifacts``, ``resources``, ``sync``, ``permissions``, ``presets``
  and ``variables`` are deep-merged (maps key by key, lists appended; then job tasks, job clusters, job
  parameters and environments with the same key are merged into one entry); ``run_as`` is replaced;
  ``mode`` becomes ``bundle.mode``; a target variable given as a plain value is its ``default``, and a
  target ``default`` replaces a root ``lookup`` (and the other way round);
- a variable's value: ``--var`` > ``BUNDLE_VAR_<name>`` > default (target, then root) > ``lookup``;
  a ``lookup`` (a warehouse by name, ...) needs the workspace, so it stays unresolved here;
- ``python.mutators`` (``databricks-bundles`` job mutators such as the bundle's compute switch): run on
  every job once the variables have values, before the resources' references are resolved;
- references: ``${var.NAME}`` (``${variables.NAME.value}``), ``${bundle.*}``, ``${workspace.*}``.
  A string that is exactly one reference takes the referenced value with its type (a list stays a
  list); inside longer text the value is formatted in. Variables may reference other variables;
  a cycle is an error. ``$${...}`` is a literal, not a reference.

What needs the workspace (``${workspace.current_user.*}`` without an :class:`Identity`, lookups,
``${resources.*}``) is left exactly as written, for the caller to accept or reject.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The CLI's reference syntax (libs/dyn/dynvar): ${a.b[0].c}; "$${...}" escapes it.
REFERENCE = re.compile(r"(?<!\$)\$\{([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*|\[\d+\])*)\}")

# Target keys the CLI deep-merges into the root (root.go MergeTargetOverrides).
_MERGED_TARGET_FIELDS = ("bundle", "workspace", "artifacts", "resources", "sync", "permissions", "presets")

# Lists of mappings inside a job that the CLI merges by key after a target override (mutator/merge_job_*.go).
_KEYED_JOB_LISTS = {"tasks": "task_key", "job_clusters": "job_cluster_key", "parameters": "name", "environments": "environment_key"}

_SCALARS = (str, int, float, bool)


class BundleError(Exception):
    """The bundle configuration cannot be loaded or resolved (bad file, unknown variable, cycle, ...)."""

    def __init__(self, message: str, *, located: bool = False):
        super().__init__(message)
        self.located = located  # the message already says which file and key


@dataclass(frozen=True)
class Identity:
    """Who deploys: what ``${workspace.current_user.*}`` resolves to, and whether it is a service principal."""

    user_name: str
    short_name: str
    is_service_principal: bool = False

    @classmethod
    def of(cls, user_name: str, *, service_principal: bool = False) -> Identity:
        """The identity with the CLI's short name (libs/iamutil, libs/textutil): the part before ``@``,
        lower-cased, every character but a letter or digit replaced by ``_``. (For a service principal the
        CLI starts from its display name instead; pass ``short_name`` explicitly for that.)"""
        local = user_name.split("@", 1)[0].lower()
        return cls(user_name, "".join(c if c.isalpha() or c.isdigit() else "_" for c in local), service_principal)


@dataclass(frozen=True)
class Lookup:
    """A variable whose value the CLI fetches from the workspace at deploy time (e.g. a warehouse id by name)."""

    kind: str  # warehouse, cluster, service_principal, ...
    name: Any  # the object's name; may itself hold references


@dataclass(frozen=True)
class BundleConfig:
    """One target's merged configuration, before and after references are resolved."""

    root: Path
    target: str | None  # None: no bundle target applied (the local runner's view)
    mode: str | None  # the target's mode: development, production or none
    files: tuple[Path, ...]  # databricks.yml first, then every included file
    document: dict[str, Any]  # merged, references as written: what the CLI's JSON schema describes
    resolved: dict[str, Any]  # the same with every reference resolvable offline resolved
    variables: dict[str, Any]  # name -> resolved value; a Lookup for a lookup variable without a value
    unset: tuple[str, ...]  # declared variables with no value at all (the CLI refuses those)
    sources: dict[tuple[str, str], Path]  # (resource type, key) -> the file that defines it
    identity: Identity | None

    def source_of(self, kind: str, key: str) -> Path:
        """The file that defines resource ``kind.key`` (relative paths in it are relative to that file)."""
        return self.sources.get((kind, key), self.root / "databricks.yml")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise BundleError(f"{path}: cannot read: {err}") from err
    except yaml.YAMLError as err:
        raise BundleError(f"{path}: not valid YAML: {err}") from err
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise BundleError(f"{path}: expected a mapping at the top level")
    return document


def deep_merge(base: Any, override: Any) -> Any:
    """The CLI's merge (libs/dyn/merge): maps merged key by key, lists appended, anything else replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = deep_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return [*base, *copy.deepcopy(override)]
    if override is None:  # an empty YAML key ("dev:") overrides nothing
        return base
    return copy.deepcopy(override)


def _merge_keyed(items: list[Any], key: str) -> list[Any]:
    """Entries of ``items`` with the same ``key`` merged into the first one, in first-seen order."""
    merged: dict[Any, Any] = {}
    loose: list[Any] = []
    for item in items:
        if isinstance(item, dict) and key in item:
            merged[item[key]] = deep_merge(merged[item[key]], item) if item[key] in merged else item
        else:
            loose.append(item)
    return [*merged.values(), *loose]


def _load_files(root: Path) -> tuple[dict[str, Any], list[Path], dict[tuple[str, str], Path]]:
    root_file = root / "databricks.yml"
    if not root_file.is_file():
        raise BundleError(f"{root}: no databricks.yml")
    document = read_yaml(root_file)
    files = [root_file]
    sources: dict[tuple[str, str], Path] = {}
    for kind, entries in (document.get("resources") or {}).items():
        for key in entries or {}:
            sources[(kind, key)] = root_file
    includes = document.get("include") or []
    if not isinstance(includes, list):
        raise BundleError(f"{root_file}: include must be a list of glob patterns")
    for pattern in includes:
        for path in sorted(p.resolve() for p in root.glob(str(pattern)) if p.is_file()):
            if path in files:
                continue
            fragment = read_yaml(path)
            for kind, entries in (fragment.get("resources") or {}).items():
                for key in entries or {}:
                    if (kind, key) in sources:
                        raise BundleError(f"{path}: {kind}.{key} is already defined in {sources[(kind, key)]}")
                    sources[(kind, key)] = path
            document = deep_merge(document, {k: v for k, v in fragment.items() if k != "include"})
            files.append(path)
    return document, files, sources


def _apply_target(document: dict[str, Any], name: str, root_file: Path) -> dict[str, Any]:
    targets = document.get("targets") or {}
    if name not in targets:
        raise BundleError(f"{root_file}: no target {name!r} (targets: {', '.join(sorted(targets)) or 'none'})")
    target = targets[name] or {}
    merged = {k: v for k, v in document.items() if k != "targets"}
    for key in _MERGED_TARGET_FIELDS:
        if target.get(key) is not None:
            merged[key] = deep_merge(merged.get(key) or {}, target[key])

    declared = merged.get("variables") or {}
    variables = {k: dict(v) if isinstance(v, dict) else v for k, v in declared.items()}
    for var_name, value in (target.get("variables") or {}).items():
        if var_name not in declared:
            raise BundleError(f"{root_file}: targets.{name}.variables: variable {var_name} is not defined but is assigned a value")
        spec = variables[var_name] if isinstance(variables[var_name], dict) else {}
        is_complex = spec.get("type") == "complex"
        if not isinstance(value, dict) or (is_complex and not ({"default", "lookup"} & set(value))):
            value = {"default": value}  # the shorthand `name: value`
        spec = deep_merge(spec, {k: v for k, v in value.items() if k not in ("default", "lookup")})
        # A target's default replaces a root lookup and the other way round; they are never combined.
        if "default" in value:
            spec.pop("lookup", None)
            spec["default"] = copy.deepcopy(value["default"])
        if "lookup" in value:
            spec.pop("default", None)
            spec["lookup"] = copy.deepcopy(value["lookup"])
        variables[var_name] = spec
    if variables:
        merged["variables"] = variables

    # The CLI also records the target's name and mode under `bundle`, as read-only fields outside its
    # schema; they are kept out of the document (BundleConfig.target/.mode hold them) so it stays checkable.
    bundle = dict(merged.get("bundle") or {})
    for key in ("compute_id", "cluster_id"):
        if target.get(key) is not None:
            bundle[key] = target[key]
    if target.get("git") is not None:
        bundle["git"] = deep_merge(bundle.get("git") or {}, target["git"])
    merged["bundle"] = bundle
    if target.get("run_as") is not None:
        merged["run_as"] = copy.deepcopy(target["run_as"])  # replaced, not merged

    for job in ((merged.get("resources") or {}).get("jobs") or {}).values():
        if isinstance(job, dict):
            for list_key, item_key in _KEYED_JOB_LISTS.items():
                if isinstance(job.get(list_key), list):
                    job[list_key] = _merge_keyed(job[list_key], item_key)
    return merged


class _Resolver:
    """Resolves references against one merged document; memoises variables and detects cycles."""

    def __init__(
        self,
        document: dict[str, Any],
        values: dict[str, Any],
        identity: Identity | None,
        target: str | None,
        locate: Callable[[tuple[str | int, ...]], str] = lambda path: ".".join(map(str, path)),
    ):
        self.document = document
        self.locate = locate  # document path -> "file: key.path" for error messages
        self.values = values  # name -> raw value, a Lookup, or _UNSET
        self.identity = identity
        self.target = target
        self.done: dict[str, Any] = {}

    def variable(self, name: str, stack: tuple[str, ...]) -> Any:
        if name in self.done:
            return self.done[name]
        if name not in self.values:
            declared = ", ".join(sorted(self.values)) or "none"
            raise BundleError(f"unknown variable ${{var.{name}}} (defined: {declared})")
        if name in stack:
            raise BundleError(f"cycle in variable references: {' -> '.join(f'${{var.{n}}}' for n in (*stack, name))}")
        raw = self.values[name]
        if raw is _UNSET:
            raise BundleError(
                f"no value assigned to required variable {name}; give it with --var {name}=VALUE or BUNDLE_VAR_{name}"
                + (f", or in targets.{self.target}.variables" if self.target else "")
            )
        if isinstance(raw, Lookup):
            value: Any = raw
        else:
            value = self.value(raw, (*stack, name), ("variables", name, "default"))
        self.done[name] = value
        return value

    def reference(self, path: str, stack: tuple[str, ...]) -> Any:
        """The value of ``${path}``, or _DEFERRED when only a deploy can know it."""
        parts = path.split(".")
        if parts[0] == "var" or (parts[0] == "variables" and len(parts) >= 3 and parts[2] == "value"):
            value = self.variable(parts[1], stack)
            if isinstance(value, Lookup):
                return _DEFERRED
            rest = parts[2:] if parts[0] == "var" else parts[3:]
            for part in rest:  # ${var.cfg.key} into a complex variable
                if not isinstance(value, dict) or part not in value:
                    raise BundleError(f"${{{path}}}: variable {parts[1]} has no field {part}")
                value = value[part]
            return value
        if path == "bundle.target":
            return self.target if self.target is not None else _DEFERRED
        if parts[0] == "workspace" and parts[1:2] == ["current_user"]:
            if self.identity is None or len(parts) != 3:
                return _DEFERRED
            known = {"userName": self.identity.user_name, "short_name": self.identity.short_name}
            return known.get(parts[2], _DEFERRED)
        if parts[0] in ("bundle", "workspace"):
            node: Any = self.document
            for part in parts:
                if not isinstance(node, dict) or part not in node:
                    return _DEFERRED  # filled in by the CLI (defaults, git, ...): not known offline
                node = node[part]
            if f"@{path}" in stack:
                raise BundleError(f"cycle in references through ${{{path}}}")
            return self.value(node, (*stack, f"@{path}"), tuple(parts))
        return _DEFERRED  # ${resources.*}, ${artifacts.*}: known after deploy

    def value(self, value: Any, stack: tuple[str, ...] = (), path: tuple[str | int, ...] = ()) -> Any:
        """``value`` (found at ``path`` in the document) with its references resolved."""
        if isinstance(value, dict):
            return {k: self.value(v, stack, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, stack, (*path, i)) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        try:
            return self._text(value, stack)
        except BundleError as err:
            if err.located:
                raise
            raise BundleError(f"{self.locate(path)}: {err}", located=True) from None

    def _text(self, value: str, stack: tuple[str, ...]) -> Any:
        whole = REFERENCE.fullmatch(value)
        if whole:
            resolved = self.reference(whole.group(1), stack)
            return value if resolved is _DEFERRED else resolved

        def substitute(match: re.Match[str]) -> str:
            resolved = self.reference(match.group(1), stack)
            if resolved is _DEFERRED:
                return match.group(0)
            if not isinstance(resolved, _SCALARS):
                raise BundleError(f"${{{match.group(1)}}} is a {type(resolved).__name__}; only a whole value can be one, not part of {value!r}")
            return str(resolved).lower() if isinstance(resolved, bool) else str(resolved)

        return REFERENCE.sub(substitute, value)


_UNSET = object()
_DEFERRED = object()


def _variable_values(
    document: dict[str, Any], overrides: Mapping[str, Any], environ: Mapping[str, str], where: Path
) -> tuple[dict[str, Any], list[str]]:
    declared = document.get("variables") or {}
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise BundleError(f"{where}: no variable named {', '.join(unknown)} (declared: {', '.join(sorted(declared)) or 'none'})")
    values: dict[str, Any] = {}
    unset: list[str] = []
    for name, spec in declared.items():
        spec = spec if isinstance(spec, dict) else {"default": spec}
        is_complex = spec.get("type") == "complex"
        env_name = f"BUNDLE_VAR_{name}"
        if name in overrides or env_name in environ:
            if is_complex:
                raise BundleError(f"variable {name} is complex: set it in databricks.yml, not with --var or {env_name}")
            values[name] = str(overrides[name]) if name in overrides else environ[env_name]
        elif "default" in spec and spec["default"] is not None:
            values[name] = spec["default"]
        elif isinstance(spec.get("lookup"), dict) and spec["lookup"]:
            (kind, lookup_name), *more = spec["lookup"].items()
            if more:
                raise BundleError(f"{where}: variable {name}: a lookup names exactly one object, got {', '.join(spec['lookup'])}")
            values[name] = Lookup(kind, lookup_name)
        else:
            values[name] = _UNSET
            unset.append(name)
    return values, unset


def _load_mutator(root: Path, name: str) -> Any:
    """The ``module:function`` of a ``python.mutators`` entry, imported as the CLI imports it (with the bundle
    root as working directory). A module file inside the bundle is loaded from this root's own copy, never
    from ``sys.modules``: two copies of one bundle (as the tests make) must not share a mutator."""
    where = f"{root / 'databricks.yml'}: python.mutators"
    module_name, _, function = name.partition(":")
    if not (module_name and function):
        raise BundleError(f"{where}: {name!r} is not module:function (e.g. resources.compute:choose_compute)")
    path = root.joinpath(*module_name.split(".")).with_suffix(".py")
    try:
        if path.is_file():
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise BundleError(f"{where}: cannot import {module_name} for {name} ({err}); it is neither a file in {root} nor installed") from err
    if not hasattr(module, function):
        raise BundleError(f"{where}: {module_name} has no {function} (listed as {name})")
    return getattr(module, function)


def _apply_job_mutators(
    root: Path, document: dict[str, Any], target: str | None, variables: Mapping[str, Any], locate: Callable[[tuple[str | int, ...]], str]
) -> None:
    """Rewrite ``document``'s jobs with the bundle's ``python.mutators``, as ``databricks-bundles`` does for
    the CLI (``databricks.bundles.build``): each job typed, handed to each mutator in order, kept as returned.
    Only job mutators are applied; the bundle has no other kind, and one would be refused here."""
    names = (document.get("python") or {}).get("mutators") or []
    if not names:
        return
    try:
        from databricks.bundles.core import Bundle, ResourceMutator
        from databricks.bundles.jobs import Job
    except ImportError as err:
        raise BundleError(f"{root / 'databricks.yml'}: python.mutators needs databricks-bundles, which is not installed: pip install 'rulewatch[local]' ({err})") from err
    # Lookups are only known to a deploy; the mutators see the variables that have a value.
    bundle = Bundle(target=target or "", variables={k: v for k, v in variables.items() if not isinstance(v, Lookup)})
    jobs = (document.get("resources") or {}).get("jobs") or {}
    for name in names:
        mutator = _load_mutator(root, str(name))
        if not isinstance(mutator, ResourceMutator) or mutator.resource_type is not Job:
            raise BundleError(f"{root / 'databricks.yml'}: python.mutators: {name} is not a @job_mutator; only job mutators are applied offline")
        takes_bundle = len(inspect.signature(mutator.function).parameters) == 2
        for key, definition in jobs.items():
            try:
                job = Job.from_dict(copy.deepcopy(definition))
            except (TypeError, ValueError):
                # A key or value the typed class refuses is one the schema refuses too: that check names
                # every such fault (the CLI would stop at the first); the job stays as written.
                continue
            try:
                changed = mutator.function(copy.deepcopy(bundle), job) if takes_bundle else mutator.function(job)
            except Exception as err:  # the mutator's own refusal (a bad variable value, ...) is the bundle's error
                raise BundleError(f"{locate(('resources', 'jobs', key))}: python mutator {name}: {err}", located=True) from err
            if changed is not job:
                jobs[key] = changed.as_dict()


def load_config(
    root: Path,
    target: str | None = None,
    variables: Mapping[str, Any] | None = None,
    *,
    identity: Identity | None = None,
    environ: Mapping[str, str] | None = None,
    target_defaults: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> BundleConfig:
    """Load, merge and resolve the bundle at ``root`` for ``target`` (None: no target applied).

    With ``strict``, every declared variable must have a value, as ``databricks bundle validate``
    demands; otherwise only a variable that is referenced must (what a local run needs).

    ``variables`` are ``--var`` values; ``environ`` supplies ``BUNDLE_VAR_*`` (default: this process's
    environment); ``target_defaults`` act as a target's variable values when ``target`` is None (the local
    runner's stand-in for a target). ``identity`` is who deploys; without it ``${workspace.current_user.*}``
    stays unresolved.
    """
    root = root.resolve()
    root_file = root / "databricks.yml"
    document, files, sources = _load_files(root)
    mode = None
    if target is not None:
        mode = ((document.get("targets") or {}).get(target) or {}).get("mode")
        document = _apply_target(document, target, root_file)
    else:
        document = {k: v for k, v in document.items() if k != "targets"}
        if target_defaults:
            declared = document.get("variables") or {}
            document["variables"] = {
                name: {**(spec if isinstance(spec, dict) else {}), "default": target_defaults[name]} if name in target_defaults else spec
                for name, spec in declared.items()
            }
    values, unset = _variable_values(document, dict(variables or {}), os.environ if environ is None else environ, root_file)
    if strict and unset:
        raise BundleError(
            f"{root_file}: no value assigned to required variable{'s' if len(unset) > 1 else ''} {', '.join(unset)}"
            f"{f' in target {target}' if target else ''}; give each with --var NAME=VALUE or BUNDLE_VAR_NAME"
        )

    def locate(path: tuple[str | int, ...]) -> str:
        # resources.<kind>.<key>... lives in the file that defines that resource; anything else in databricks.yml.
        where = sources.get((str(path[1]), str(path[2])), root_file) if len(path) > 2 and path[0] == "resources" else root_file
        dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        return f"{where}: {dotted}" if dotted else str(where)

    resolver = _Resolver(document, values, identity, target, locate)
    # Lookup names may reference other variables (but not another lookup, as in the CLI).
    for name, value in values.items():
        if isinstance(value, Lookup):
            for match in REFERENCE.finditer(str(value.name)):
                ref = match.group(1).split(".")
                if ref[0] == "var" and isinstance(values.get(ref[1]), Lookup):
                    raise BundleError(f"{root_file}: variable {name}: lookup variables cannot contain references to another lookup variable ({ref[1]})")
            values[name] = Lookup(value.kind, resolver.value(value.name, (name,)))
    resolved_variables = {name: resolver.variable(name, ()) for name in values if values[name] is not _UNSET}
    # After the variables and before the resources' references, as the CLI runs them: the mutators see
    # the variables' values and the jobs as written, and whatever they write is resolved like the rest.
    _apply_job_mutators(root, document, target, resolved_variables, locate)
    resolved = resolver.value(document)
    return BundleConfig(
        root=root,
        target=target,
        mode=mode,
        files=tuple(files),
        document=document,
        resolved=resolved,
        variables=resolved_variables,
        unset=tuple(unset),
        sources=sources,
        identity=identity,
    )


def bundle_files(root: Path) -> list[Path]:
    """databricks.yml and every file its ``include`` globs match, in the order the CLI merges them."""
    return _load_files(root.resolve())[1]


def target_names(root: Path) -> list[str]:
    """Every target declared in the bundle (databricks.yml and includes)."""
    document, _, _ = _load_files(root.resolve())
    return list((document.get("targets") or {}).keys())


def references_in(value: Any) -> list[str]:
    """Every ``${...}`` reference path anywhere inside ``value``, in order."""
    found: list[str] = []
    if isinstance(value, dict):
        for item in value.values():
            found += references_in(item)
    elif isinstance(value, list):
        for item in value:
            found += references_in(item)
    elif isinstance(value, str):
        found += [m.group(1) for m in REFERENCE.finditer(value)]
    return found

