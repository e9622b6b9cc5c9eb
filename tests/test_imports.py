"""The import direction, checked on the source: every import statement of every module (at module
top and inside functions, where lazy imports hide), parsed with `ast`, nothing executed.

    core (kb/*)  <-  ingest/, agents/, runner/  <-  facade (kb/api.py, kb/cli/)  <-  leaves
    leaves: the framework callbacks (ingest/callbacks.py, ingest/lightning_callback.py) and the UI

    pytest tests/test_imports.py -q
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kb", "ingest", "agents", "runner")
FACADE = ("kb.api", "kb.cli")
CALLBACKS = ("ingest.callbacks", "ingest.lightning_callback")
# a module that imports a web framework is UI (the REST server, the Gradio app), whatever its name;
# so is every module of the UI's and the server's packages, framework or not
UI_FRAMEWORKS = ("gradio", "fastapi", "starlette")
UI_PACKAGES = ("kb.ui", "kb.server")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """Every dotted name `name`'s source imports, anywhere in the file; relative imports resolved.

    `from kb import indexer` imports the module kb.indexer, not the package kb: a package's
    __init__ runs before any of its modules anyway, so it is no edge of its own."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def graph() -> tuple[dict[str, set[str]], set[str]]:
    """(edges between the project's own modules, the UI modules)."""
    mods = modules()
    edges, ui = {}, set()
    for name, path in mods.items():
        names = imported_names(name, path, set(mods))
        if any(n.split(".")[0] in UI_FRAMEWORKS for n in names) or under(name, UI_PACKAGES):
            ui.add(name)
        edges[name] = {n for n in names if n in mods and n != name}
    return edges, ui


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None."""
    state: dict[str, int] = {}        # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.fixture(scope="module")
def imports():
    return graph()


def test_the_scanner_sees_lazy_imports(imports):
    edges, _ = imports
    # KnowledgeBase.ingest imports the detector inside the method: a scanner that reads only
    # module-level imports would pass everything below vacuously
    assert "ingest.detect" in edges["kb.api"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_no_reader_agent_runner_or_ui(imports):
    edges, ui = imports
    bad = [f"{m} -> {t}" for m, targets in edges.items()
           if under(m, ("kb",)) and not under(m, FACADE) and m not in ui
           for t in sorted(targets) if under(t, ("ingest", "agents", "runner")) or t in ui]
    assert not bad, "only the facade (kb.api, kb.cli) may import these:\n" + "\n".join(bad)


def test_readers_agents_and_runner_do_not_import_the_facade(imports):
    edges, ui = imports
    bad = [f"{m} -> {t}" for m, targets in edges.items()
           if under(m, ("ingest", "agents", "runner")) and not under(m, CALLBACKS) and m not in ui
           for t in sorted(targets) if under(t, FACADE)]
    assert not bad, "pass a KnowledgeBase in rather than importing the API:\n" + "\n".join(bad)


def test_callbacks_and_ui_are_leaves(imports):
    edges, ui = imports
    bad = [f"{m} -> {t}" for m, targets in edges.items() for t in sorted(targets)
           if under(t, CALLBACKS) or (t in ui and not under(m, FACADE) and m not in ui)]
    assert not bad, "nothing imports a framework callback, and only the facade imports the UI:\n" + "\n".join(bad)


def test_ingest_imports_neither_agents_nor_runner(imports):
    edges, _ = imports
    bad = [f"{m} -> {t}" for m, targets in edges.items() if under(m, ("ingest",))
           for t in sorted(targets) if under(t, ("agents", "runner"))]
    assert not bad, "\n".join(bad)


def test_no_import_loops(imports):
    edges, _ = imports
    cycle = find_cycle(edges)
    assert cycle is None, "import loop: " + " -> ".join(cycle)
