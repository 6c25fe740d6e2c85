"""rloo_engine never imports Prefect, tasks or flows; imports point flows -> tasks -> rloo_engine."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_engine_never_imports_prefect_tasks_or_flows():
    offenders = {
        str(p.relative_to(ROOT)): sorted(imported_roots(p) & {"prefect", "tasks", "flows"})
        for p in (ROOT / "rloo_engine").rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_tasks_never_import_flows():
    offenders = [str(p) for p in (ROOT / "tasks").rglob("*.py") if "flows" in imported_roots(p)]
    assert not offenders
