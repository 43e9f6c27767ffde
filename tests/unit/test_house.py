"""The house's size rules: every package stays small enough to read.

No module over 1,000 lines, no class over 650, no function over 120, in every
package (the kernel, the three programs, the benchmarks, the e2e fleet).
Where code grows past a limit it is two things, and wants to be split by what
it does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "common/cachefleet_common",
    "sidecar/cachefleet_sidecar",
    "operator/cachefleet_operator",
    "router/cachefleet_router",
    "bench/cachefleet_bench",
    "e2e/cachefleet_e2e",
)
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 1000, 650, 120


def _too_big(path: Path) -> list[str]:
    source = path.read_text()
    name = path.relative_to(ROOT)
    out = []
    if (lines := source.count("\n")) > MAX_MODULE:
        out.append(f"{name}: {lines} lines (module limit {MAX_MODULE})")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        size = (node.end_lineno or node.lineno) - node.lineno + 1
        if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
            out.append(f"{name}:{node.lineno} class {node.name}: {size} lines (limit {MAX_CLASS})")
        elif not isinstance(node, ast.ClassDef) and size > MAX_FUNCTION:
            out.append(f"{name}:{node.lineno} {node.name}(): {size} lines (limit {MAX_FUNCTION})")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_class_or_function_is_over_its_limit(package: str) -> None:
    offenders = [o for path in sorted((ROOT / package).rglob("*.py")) for o in _too_big(path)]
    assert not offenders, "split by what it does:\n" + "\n".join(offenders)


def _circles(package: str) -> list[list[str]]:
    """The import circles inside ``package`` (strongly connected modules), type hints too."""
    import grimp  # import-linter's own graph builder

    graph = grimp.build_graph(package)
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i.startswith(package))
        for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges.get(module, []):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return out


@pytest.mark.parametrize(
    "package",
    ["cachefleet_common", "cachefleet_sidecar", "cachefleet_operator", "cachefleet_router"],
)
def test_no_package_has_an_import_circle(package: str) -> None:
    assert _circles(package) == []
