"""Lower layers never import higher ones (STYLE.md: config/errors -> source/manifests -> ...).

Backends know nothing of HTTP; source and manifests know nothing of backends.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gitops_sless"

# a module may import only modules of a lower or equal rank
RANKS = {
    "errors": 0,
    "paths": 0,
    "metrics": 0,
    "logs": 0,
    "timestamps": 0,
    "redact": 0,
    "tokenfile": 0,
    "yamldoc": 1,
    "cron": 1,
    "source": 1,
    "fetcher": 1,
    "known_hosts": 1,
    "routes": 1,
    "store": 1,
    "webhooks": 1,
    "pulls": 1,
    "trust": 1,
    "forgehttp": 1,
    "identity": 2,
    "runtimes": 2,
    "schema": 2,
    "templates": 2,
    "netpolicy": 1,
    "mirror": 2,
    "forge": 2,
    "reporter": 2,
    "seed": 2,
    "manifest": 3,
    "reference": 3,
    "renderer": 4,
    "dependencies": 4,
    "backend": 4,
    "backoff": 0,
    "inflight": 0,
    "serving": 5,
    "phases": 5,
    "records": 2,
    "planner": 5,
    "diff": 5,
    "local": 6,
    "local.secrets": 6,
    "local.builder": 6,
    "local.processes": 6,
    "local.scheduler": 6,
    "local.backend": 6,
    "local.orphans": 6,
    "local.memory": 6,
    "local.gc": 6,
    "failure": 1,
    "local.depcache": 6,
    "local.installers": 6,
    "local.sandbox": 6,
    "local.replica_logs": 6,
    "local.logfiles": 6,
    "local.leftovers": 6,
    "kube": 6,
    "kube.contexts": 6,
    "kube.storage": 6,
    "kube.client": 6,
    "kube.credentials": 6,
    "kube.informer": 6,
    "kube.view": 6,
    "kube.status": 6,
    "kube.apply": 6,
    "kube.builds": 6,
    "kube.jobs": 6,
    "kube.settings": 6,
    "kube.backend": 6,
    "kube.connect": 6,
    "kube.functions": 6,
    "kube.leader": 6,
    "kube.mirror": 6,
    "kube.runs": 6,
    "kube.gateway": 6,
    "kube.registry": 6,
    "kube.gc": 6,
    "kube.cronruns": 6,
    # the proxy package's modules import one way: http, upstream, fast, app, the package
    "proxy.http": 7.1,
    "proxy.upstream": 7.2,
    "proxy.fast": 7.3,
    "proxy.app": 7.4,
    "proxy": 7.5,
    # import terraform: reads manifests to validate what it writes, nothing above
    "tfimport.problems": 4,
    "tfimport.hcl": 4,
    "tfimport.evaluate": 4,
    "tfimport.variables": 4,
    "tfimport.refusals": 4,
    "tfimport.convert": 4,
    "tfimport.write": 4,
    "tfimport.migrating": 4,
    "tfimport.run": 4,
    "tfimport": 4,
    "reconciler": 7,
    "previews": 7,
    "api": 8,
    "api_models": 8,
    "prlinks": 1,
    "dashboard": 8,
    "access": 8,
    "serve": 9,
    # the command line: shared parts, then one module per group of verbs, then the package
    "cli.common": 9,
    "cli.output": 9,
    "cli.serve": 9.1,
    "cli.local": 9.1,
    "cli.remote": 9.1,
    "cli.completion": 9.1,
    "cli": 9.2,
    "client": 9,
    "__init__": 9,
    "__main__": 10,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    package = _module_name(path).split(".")[:-1] if path.name != "__init__.py" else []
    if path.name == "__init__.py" and path.parent != PACKAGE:
        package = [path.parent.name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
        elif (node.module or "").startswith("gitops_sless"):
            base = []
            node = ast.ImportFrom(
                node.module.removeprefix("gitops_sless").lstrip(".") or None, node.names, 1
            )
        else:
            continue
        if node.module:
            found.add(".".join([*base, node.module]))
        else:
            found.update(".".join([*base, alias.name]) for alias in node.names)
    return {name if name in RANKS else name.split(".")[0] for name in found}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_rank():
    assert {_module_name(p) for p in _modules()} == set(RANKS), "give new modules a rank"


def test_no_module_imports_a_higher_layer():
    for path in _modules():
        name = _module_name(path)
        for imported in _imports(path):
            assert RANKS[imported] <= RANKS[name], f"{name} imports the higher layer {imported}"
