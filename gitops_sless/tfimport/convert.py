"""The sless provider's resources as function folders, ``sless.yaml`` entries and secrets.

Pure: reads a parsed `Module`, returns a `Conversion`; writing it is `write.py`'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lark import Tree

from .evaluate import SLESS_TYPES, Evaluator, JobResult, Value, traversal
from .hcl import Attribute, Block, Module
from .problems import NotConvertible, Problem, Where
from .variables import load_variables

__all__ = ["Conversion", "Folder", "Outcome", "Secret", "convert"]

# an env name made of one of these words holds a credential (DB_DSN, API_KEY, PGPASSWORD)
_SECRET_WORDS = re.compile(
    r"(^|_)(PASSWORD|PASSWD|PASS|PWD|SECRET|TOKEN|DSN|KEY|APIKEY|CREDENTIALS?|PRIVATE)(_|$)"
    r"|PASSWORD|SECRET|TOKEN",
    re.IGNORECASE,
)
_FUNCTION_ATTRIBUTES = {
    "name", "runtime", "entrypoint", "memory_mb", "timeout_sec", "env_vars", "source_dir",
    "build_timeout_sec", "depends_on",
}  # fmt: skip
_TRIGGER_ATTRIBUTES = {"name", "type", "function", "schedule", "enabled", "depends_on"}
_JOB_ATTRIBUTES = {"name", "function", "event_json", "run_id", "wait_timeout_sec", "depends_on"}
_QUIET_BLOCKS = ("variable", "terraform", "provider")


@dataclass
class Folder:
    """One output folder: the code of one ``source_dir`` and the functions that share it."""

    path: str  # relative to the output, POSIX
    source: Path
    functions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Secret:
    """A value that goes to the secrets directory or a Kubernetes Secret, never to git."""

    secret: str
    key: str
    value: str
    origin: str  # where the value comes from, for the user (never the value)


@dataclass(frozen=True)
class Outcome:
    """One resource and what it became, for MIGRATING.md."""

    address: str
    where: Where
    became: str
    converted: bool = True


@dataclass
class Conversion:
    folders: list[Folder]
    secrets: list[Secret]
    outcomes: list[Outcome]
    problems: list[Problem]

    @property
    def complete(self) -> bool:
        return not any(p.severity == "not converted" for p in self.problems)


def convert(module: Module) -> Conversion:
    return _Converter(module).run()


class _Converter:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.problems: list[Problem] = [
            Problem(w, w.file, "JSON configuration is not read; convert it to HCL")
            for w in module.skipped
        ]
        self.evaluator = Evaluator(module, load_variables(module, self.problems))
        self.folders: dict[Path, Folder] = {}
        self.functions: dict[str, dict[str, Any]] = {}  # address -> sless.yaml entry
        self.by_name: dict[str, str] = {}  # function name -> address
        self.jobs: dict[str, dict[str, Any]] = {}  # address -> jobs[] entry
        self.job_functions: dict[str, str] = {}  # job address -> function address
        self.secrets: list[Secret] = []
        self.outcomes: list[Outcome] = []
        self.triggers: dict[str, list[tuple[dict[str, Any], bool, str]]] = {}

    def run(self) -> Conversion:
        by_type = {t: [] for t in SLESS_TYPES}
        for block in self.module.blocks:
            kind = block.labels[0] if block.type == "resource" and block.labels else None
            if kind in by_type and self._countable(block):
                by_type[kind].append(block)
            elif kind not in by_type:
                self._other(block)
        for block in by_type["sless_function"]:
            self._function(block)
        for block in by_type["sless_job"]:
            self._job(block)
        for fn_address, fn in self.functions.items():
            fn["env"] = self._env(fn_address)
            if not fn["env"]:
                del fn["env"]
        for block in by_type["sless_trigger"]:
            self._trigger(block)
        self._apply_triggers()
        for block in [*by_type["sless_function"], *by_type["sless_job"], *by_type["sless_trigger"]]:
            self._depends_on(block)
        for fn in self.functions.values():
            fn.pop("_env_attribute", None)
        outcomes = sorted(self.outcomes, key=lambda o: o.where)
        problems = sorted(set(self.problems), key=lambda p: (p.where, p.what))
        return Conversion(list(self.folders.values()), self.secrets, outcomes, problems)

    # --- blocks that are not sless resources ---------------------------------------------

    def _countable(self, block: Block) -> bool:
        for meta in ("count", "for_each"):
            if meta in block.attributes:
                why = f"{meta} makes one block many objects; write one block per object"
                where = block.attributes[meta].where
                self._not_converted(block, where, f"{block.address}.{meta}", why)
                return False
        return True

    def _other(self, block: Block) -> None:
        if block.type in _QUIET_BLOCKS:
            return
        if block.type == "resource":
            why = "not a sless resource: it stays managed by Terraform"
            self._not_converted(block, block.where, f"resource {block.address}", why)
        elif block.type == "module":
            why = "modules are not converted: import the module's own directory"
            self._not_converted(block, block.where, block.address, why)
        elif block.type == "data":
            self._not_converted(block, block.where, block.address, "data sources are not read")
        elif block.type == "output":
            why = "outputs have no counterpart: read results with gitops-sless status or logs --job"
            self.problems.append(Problem(block.where, block.address, why, "warning"))
        elif block.type == "locals":
            why = "local values are not evaluated; resources that use them are reported"
            self.problems.append(Problem(block.where, "locals", why, "warning"))
        else:
            self.problems.append(Problem(block.where, block.address, "ignored", "warning"))

    def _not_converted(self, block: Block, where: Where, what: str, why: str) -> None:
        self.problems.append(Problem(where, what, why))
        self.outcomes.append(Outcome(block.address, block.where, f"not converted: {why}", False))

    # --- evaluation helpers ----------------------------------------------------------------

    def _value(self, block: Block, name: str, required: bool = False) -> Value | None:
        attribute = block.attributes.get(name)
        if attribute is None:
            if required:
                raise NotConvertible(block.where, f"{block.address}.{name}", "is required")
            return None
        value = self.evaluator.attribute(attribute)
        if value.sensitive and name not in ("env_vars",):
            raise NotConvertible(
                attribute.where,
                f"{block.address}.{name}",
                f"uses the sensitive var.{', var.'.join(sorted(value.sensitive))}, and "
                "sless.yaml is committed to git",
            )
        return value

    def _string(self, block: Block, name: str, required: bool = False) -> str | None:
        value = self._value(block, name, required)
        if value is None:
            return None
        if not isinstance(value.data, str | int | float) or isinstance(value.data, bool):
            where = block.attributes[name].where
            raise NotConvertible(where, f"{block.address}.{name}", "expected a string")
        return str(value.data)

    def _int(self, block: Block, name: str) -> int | None:
        value = self._value(block, name)
        if value is None:
            return None
        try:
            return int(value.data)
        except (TypeError, ValueError):
            where = block.attributes[name].where
            raise NotConvertible(where, f"{block.address}.{name}", "expected a number") from None

    def _optional(self, block: Block, fn: Any) -> Any:
        """An optional attribute: a failure is reported and the attribute left out."""
        try:
            return fn()
        except NotConvertible as exc:
            self.problems.append(Problem(exc.where, exc.what, exc.why))
            return None

    def _unknown_attributes(self, block: Block, known: set[str]) -> None:
        for name, attribute in block.attributes.items():
            if name not in known:
                why = "not an attribute of the provider the import knows; left out"
                self.problems.append(Problem(attribute.where, f"{block.address}.{name}", why))
        for nested in block.blocks:
            why = "Terraform's own settings have no counterpart; ignored"
            self.problems.append(
                Problem(nested.where, f"{block.address} {nested.type}", why, "warning")
            )

    # --- sless_function --------------------------------------------------------------------

    def _function(self, block: Block) -> None:
        try:
            name = self._string(block, "name", required=True)
            runtime = self._string(block, "runtime", required=True)
            entrypoint = self._string(block, "entrypoint", required=True)
            source = Path(self._string(block, "source_dir", required=True))
        except NotConvertible as exc:
            self._not_converted(block, exc.where, exc.what, exc.why)
            return
        source = source if source.is_absolute() else self.module.root / source
        if not source.is_dir():
            why = f"{source} is not a directory"
            self._not_converted(
                block, block.attributes["source_dir"].where, f"{block.address}.source_dir", why
            )
            return
        fn: dict[str, Any] = {"name": name, "runtime": runtime, "entrypoint": entrypoint}
        for attr, key in (("memory_mb", "memoryMB"), ("timeout_sec", "timeoutSec")):
            number = self._optional(block, lambda a=attr: self._int(block, a))
            if number is not None:
                fn[key] = number
        if "build_timeout_sec" in block.attributes:
            why = "builds are timed by serve --build-timeout for every function; left out"
            where = block.attributes["build_timeout_sec"].where
            self.problems.append(
                Problem(where, f"{block.address}.build_timeout_sec", why, "warning")
            )
        self._unknown_attributes(block, _FUNCTION_ATTRIBUTES)
        folder = self._folder(source.resolve())
        folder.functions.append(fn)
        self.functions[block.address] = fn
        self.by_name[name] = block.address
        fn["_env_attribute"] = block.attributes.get("env_vars")
        self.outcomes.append(
            Outcome(block.address, block.where, f"function {name} in {folder.path}/sless.yaml")
        )

    def _folder(self, source: Path) -> Folder:
        if source not in self.folders:
            root = self.module.root.resolve()
            try:
                path = source.relative_to(root).as_posix()
            except ValueError:
                path = f"functions/{source.name}"
            taken = {f.path for f in self.folders.values()}
            unique, n = path, 2
            while unique in taken:
                unique, n = f"{path}-{n}", n + 1
            self.folders[source] = Folder(unique, source)
        return self.folders[source]

    def _env(self, fn_address: str) -> dict[str, Any]:
        fn = self.functions[fn_address]
        attribute: Attribute | None = fn.get("_env_attribute")
        if attribute is None:
            return {}
        env: dict[str, Any] = {}
        for key, where, value in self.evaluator.entries(attribute):
            if isinstance(value, NotConvertible):
                what = f"{fn_address}.env_vars.{key}" if key else value.what
                self.problems.append(Problem(value.where, what, f"{value.what}: {value.why}"))
                continue
            try:
                converted = self._env_value(fn, key, value, where)
            except NotConvertible as exc:
                self.problems.append(Problem(exc.where, f"{fn_address}.env_vars.{key}", exc.why))
                continue
            if converted is not None:
                env[key] = converted
        return env

    def _env_value(self, fn: dict[str, Any], key: str, value: Value, where: Where) -> Any:
        data = value.data
        if data is None:
            return None  # null leaves the variable unset, as in Terraform
        if isinstance(data, JobResult):
            if data.job not in self.jobs:
                raise NotConvertible(where, key, f"{data.job} is not converted, so no result")
            return {"job": self.jobs[data.job]["name"]}
        if isinstance(data, dict | list):
            raise NotConvertible(where, key, "env values are strings (use jsonencode)")
        text = ("true" if data else "false") if isinstance(data, bool) else str(data)
        if value.sensitive or _SECRET_WORDS.search(key):
            origin = (
                ", ".join(
                    f"var.{v} ({self.evaluator.variables[v].where})"
                    for v in sorted(value.sensitive)
                )
                if value.sensitive
                else f"{key} at {where}"
            )
            self.secrets.append(Secret(fn["name"], key, text, origin))
            return {"secret": fn["name"], "key": key}
        return text

    # --- sless_job -------------------------------------------------------------------------

    def _job(self, block: Block) -> None:
        try:
            name = self._string(block, "name", required=True)
            fn_address = self._function_of(block)
            event = self._event(block)
            run_id = self._int(block, "run_id")
        except NotConvertible as exc:
            self._not_converted(block, exc.where, exc.what, exc.why)
            return
        job: dict[str, Any] = {"name": name, "runId": 1 if run_id is None else run_id}
        if event:
            job["event"] = event
        self.functions[fn_address].setdefault("jobs", []).append(job)
        self.jobs[block.address] = job
        self.job_functions[block.address] = fn_address
        if "wait_timeout_sec" in block.attributes:
            why = "serve runs a job for its function's timeoutSec; nothing waits for it; left out"
            where = block.attributes["wait_timeout_sec"].where
            self.problems.append(
                Problem(where, f"{block.address}.wait_timeout_sec", why, "warning")
            )
        self._unknown_attributes(block, _JOB_ATTRIBUTES)
        fn_name = self.functions[fn_address]["name"]
        self.outcomes.append(
            Outcome(block.address, block.where, f"job {name} (runId {job['runId']}) of {fn_name}")
        )

    def _function_of(self, block: Block) -> str:
        name = self._string(block, "function", required=True)
        if name not in self.by_name:
            where = block.attributes["function"].where
            why = f"names the function {name!r}, which is not converted or not declared here"
            raise NotConvertible(where, f"{block.address}.function", why)
        return self.by_name[name]

    def _event(self, block: Block) -> dict[str, Any] | None:
        text = self._string(block, "event_json")
        if text is None:
            return None
        where = block.attributes["event_json"].where
        try:
            event = json.loads(text)
        except ValueError:
            raise NotConvertible(where, f"{block.address}.event_json", "is not JSON") from None
        if not isinstance(event, dict):
            why = "an event is a JSON object in sless.yaml"
            raise NotConvertible(where, f"{block.address}.event_json", why)
        return event

    # --- sless_trigger ---------------------------------------------------------------------

    def _trigger(self, block: Block) -> None:
        try:
            fn_address = self._function_of(block)
            kind = self._string(block, "type", required=True)
            if kind not in ("http", "cron"):
                where = block.attributes["type"].where
                raise NotConvertible(where, f"{block.address}.type", f"{kind!r}: http or cron")
            trigger: dict[str, Any] = {"type": kind}
            if kind == "cron":
                trigger["schedule"] = self._string(block, "schedule", required=True)
            enabled = self._value(block, "enabled")
        except NotConvertible as exc:
            self._not_converted(block, exc.where, exc.what, exc.why)
            return
        self._unknown_attributes(block, _TRIGGER_ATTRIBUTES)
        on = enabled is None or enabled.data is not False
        self.triggers.setdefault(fn_address, []).append((trigger, on, block.address))
        fn_name = self.functions[fn_address]["name"]
        self.outcomes.append(
            Outcome(
                block.address,
                block.where,
                f"{kind} trigger of {fn_name}" + ("" if on else " (disabled)"),
            )
        )

    def _apply_triggers(self) -> None:
        """A function whose triggers are all disabled is ``enabled: false``: deployed at zero."""
        for fn_address, triggers in self.triggers.items():
            fn = self.functions[fn_address]
            if not any(on for _, on, _ in triggers):
                fn["enabled"] = False
                fn["triggers"] = [t for t, _, _ in triggers]
                continue
            fn["triggers"] = [t for t, on, _ in triggers if on]
            for _trigger, on, address in triggers:
                if not on:
                    block = next(b for b in self.module.blocks if b.address == address)
                    why = (
                        f"disabled while {fn['name']} has enabled triggers: left out "
                        "(enabled: false would stop them all); add it back to enable it"
                    )
                    self.problems.append(Problem(block.where, address, why, "warning"))

    # --- depends_on ------------------------------------------------------------------------

    def _depends_on(self, block: Block) -> None:
        attribute = block.attributes.get("depends_on")
        mine = self._own_function(block)
        if attribute is None or mine is None:
            return
        items = [c for c in _elements(attribute.expr) if isinstance(c, Tree)]
        for item in items:
            found = traversal(item)
            target = f"{found[0]}.{found[1][0]}" if found and found[1] else "?"
            where = Where(attribute.where.file, getattr(item.meta, "line", attribute.where.line))
            self._order(block, mine, target, where)

    def _own_function(self, block: Block) -> str | None:
        if block.address in self.functions:
            return block.address
        if block.address in self.job_functions:
            return self.job_functions[block.address]
        for fn_address, triggers in self.triggers.items():
            if any(address == block.address for _, _, address in triggers):
                return fn_address
        return None

    def _order(self, block: Block, mine: str, target: str, where: Where) -> None:
        if target == mine:
            return  # a job or trigger always comes with its own function
        env = self.functions[mine].get("env", {})
        if target in self.jobs and {"job": self.jobs[target]["name"]} in env.values():
            return  # the function (and its jobs) wait for the job whose result they take
        what = f"{block.address} depends_on {target}"
        why = (
            "gitops-sless does not order these: each function and job moves on its own, "
            "only a {job: NAME} env value makes one wait for a job"
        )
        self.problems.append(Problem(where, what, why, "warning"))


def _elements(expr: Any) -> list[Any]:
    node = expr
    while getattr(node, "data", None) == "expr_term":
        node = next(c for c in node.children if getattr(c, "data", "") != "new_line_or_comment")
    if getattr(node, "data", None) != "tuple":
        return []
    return [c for c in node.children if getattr(c, "data", "") not in ("new_line_or_comment", "")]
