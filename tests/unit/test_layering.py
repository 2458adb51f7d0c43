"""What never imports what (docs/architecture.md): the core library (areal_mq/) never imports a role
(workers/) or a broker (brokers/), except the command-line entry points that start them by name; roles and
brokers never import each other. Checked on the source, so a lazy import inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"areal_mq/cli.py", "areal_mq/rewards/cli.py"}  # `areal-mq broker|worker|reward serve`


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def offenders(folder: str, forbidden: tuple[str, ...], allowed: set[str] = frozenset()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        bad += [f"{rel} imports {m}" for m in sorted(imports(path)) if m.startswith(forbidden)]
    return bad


def test_the_core_imports_no_role_and_no_broker():
    assert offenders("areal_mq", ("areal_mq.workers", "areal_mq.brokers"), ENTRY_POINTS) == []


def test_roles_and_brokers_never_import_each_other():
    assert offenders("workers", ("areal_mq.brokers",)) == []
    assert offenders("brokers", ("areal_mq.workers",)) == []
