"""Imports point one way (flows -> tasks -> rloo_engine), the library never imports Prefect, the engine never imports
its own test helpers, `tasks/` holds only Prefect task modules, and no import circle exists anywhere."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT_ROOTS = ("rloo_engine", "tasks", "flows")
# Modules allowed to import rloo_engine.testing: the demo builds its assets with the tiny-model builders, and
# `rloo-engine tiny-assets` is the command that writes them.
TESTING_IMPORTERS = {"rloo_engine/cli.py"}
TESTING_IMPORTER_DIRS = ("rloo_engine/demo/",)
# tasks/ modules that define no @task: Prefect-side helpers that cannot live in the Prefect-free library.
TASK_HELPERS = {"tasks/__init__.py", "tasks/secrets.py", "tasks/train_nodes.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports in functions count too)."""
    if package is None:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from pkg import submodule` imports the submodule too.
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def project_files(root: str) -> list[Path]:
    return sorted((ROOT / root).rglob("*.py"))


def roots_of(path: Path) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(path)}


def test_engine_never_imports_prefect_tasks_or_flows():
    # rloo_engine/pipeline/ is the library home of the pipeline's logic: it is covered by this rule too.
    offenders = {
        str(p.relative_to(ROOT)): sorted(roots_of(p) & {"prefect", "tasks", "flows"}) for p in project_files("rloo_engine")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_tasks_never_import_flows():
    offenders = [str(p) for p in project_files("tasks") if "flows" in roots_of(p)]
    assert not offenders


def test_engine_never_imports_its_test_helpers():
    offenders = []
    for p in project_files("rloo_engine"):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("rloo_engine/testing/") or rel in TESTING_IMPORTERS or rel.startswith(TESTING_IMPORTER_DIRS):
            continue
        if any(m == "rloo_engine.testing" or m.startswith("rloo_engine.testing.") for m in imported_modules(p)):
            offenders.append(rel)
    assert not offenders, f"engine modules importing rloo_engine.testing: {offenders}"


def test_tasks_holds_only_prefect_task_modules():
    def defines_task(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    if isinstance(target, ast.Name) and target.id == "task":
                        return True
        return False

    plain = [p.relative_to(ROOT).as_posix() for p in project_files("tasks")]
    offenders = [p for p in plain if p not in TASK_HELPERS and not defines_task(ROOT / p)]
    assert not offenders, f"tasks/ modules without a @task belong in rloo_engine/pipeline/: {offenders}"


def test_no_import_circle():
    modules = {module_name(p): p for root in PROJECT_ROOTS for p in project_files(root)}
    graph = {m: {i for i in imported_modules(p) if i in modules and i != m} for m, p in modules.items()}
    # A package's __init__ re-exporting its submodules is the one allowed back edge (Python resolves it).
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    circles = _cycles(graph)
    assert not circles, f"import circles: {circles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import prefect\n", "prefect"),
        ("from prefect.blocks.system import Secret\n", "prefect.blocks.system"),
        ("def f():\n    from tasks import train\n", "tasks.train"),
        ("from ..testing import tiny_models\n", "rloo_engine.testing.tiny_models"),
        ("from .fake_batch_api import FakeBatchAPI\n", "rloo_engine.evaluation.fake_batch_api"),
    ],
)
def test_the_rules_see_direct_lazy_and_relative_imports(tmp_path, source, expected):
    module = tmp_path / "mod.py"
    module.write_text(source)
    assert expected in imported_modules(module, package="rloo_engine.evaluation")


def test_the_circle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
