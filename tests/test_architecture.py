"""The floor plan holds: the package's import graph, built from the source, has no cycle and only
imports downward through the layers of docs/design.md; front ends reach engines only through
`EngineClient`; files stay small; docstrings cite only files the repository has."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "jupyter_pagedkv"

# Lower layers first; a module may import its own package and any lower layer, nothing else.
LAYERS = [
    {"core", "config"},
    {"worker"},
    {"decoding"},        # above worker: a draft model needs a runner, verification the sampler
    {"engine"},
    {"protocol"},
    {"monitor"},
    {"widgets"},
    {"remote"},
    {"sim"},
    {"notebook"},
    {"bench", "docs"},    # docs: runs the transcripts the docs quote
    {"__init__", "__main__"},
]
UPPER = {"protocol", "monitor", "widgets", "remote", "sim", "notebook", "bench", "docs"}
# What only the engine (and the core it owns) may touch on an engine object.
ENGINE_INTERNALS = {"_lock", "_requests", "_scheduler", "_pool", "_runner", "_speculator", "_swap", "_kv_cache",
                    "_stepping", "_inspection", "_config"}
SCHEDULER_LISTS = {"running", "waiting", "swapped"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "labextension" not in p.parts}


def area(module: str) -> str:
    """The top-level piece of the package a module belongs to ("core", "engine", "__init__" ...)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if area(module) in names)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports_of(module: str, source: str | None = None) -> set[str]:
    """Every package module `module` imports, inside functions too, `if TYPE_CHECKING:` excepted."""
    path = MODULES[module]
    tree = ast.parse(path.read_text() if source is None else source)
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "jupyter_pagedkv":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    found.discard(module)
    return {m for m in found if m in MODULES}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_graph_is_read_from_every_module_and_sees_imports_inside_functions():
    assert len(MODULES) > 40
    # Lazy imports count: the package root reaches the widgets only inside a function.
    assert "jupyter_pagedkv.widgets.block_pool_monitor" in GRAPH["jupyter_pagedkv"]
    # TYPE_CHECKING imports do not: the widget names EngineClient only for type hints.
    assert "jupyter_pagedkv.protocol" not in GRAPH["jupyter_pagedkv.widgets.block_pool_monitor"]


def test_no_cycle_between_files():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {n}" for m, targets in graph.items() for n in sorted(targets)
            if area(n) != area(m) and layer(n) >= layer(m)]


def test_imports_only_go_down_the_layers():
    found = upward(GRAPH)
    assert not found, "upward or sideways imports:\n" + "\n".join(found)


def test_a_planted_upward_import_inside_a_function_is_caught():
    module = "jupyter_pagedkv.core.stats"
    planted = MODULES[module].read_text() + "\n\ndef _draw():\n    from ..widgets import pool_figure\n"
    graph = {**GRAPH, module: imports_of(module, planted)}
    assert upward(graph) == [f"{module} -> jupyter_pagedkv.widgets.pool_figure"]
    hidden = MODULES[module].read_text() + "\nif TYPE_CHECKING:\n    from ..widgets import pool_figure\n"
    assert not upward({**GRAPH, module: imports_of(module, hidden)})


def test_the_package_root_is_imported_by_no_module_inside_it():
    users = sorted(m for m, targets in GRAPH.items() if "jupyter_pagedkv" in targets)
    assert not users, f"import the module that defines a name, not the package root: {users}"


def _foreign_attributes(module: str, names: set[str]) -> list[str]:
    """`x.name` for `name` in `names` where x is not `self` (attributes of another object)."""
    tree = ast.parse(MODULES[module].read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                hits.append(f"{MODULES[module].relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return hits


def test_front_ends_reach_an_engine_only_through_its_interface():
    hits = [h for m in MODULES if area(m) in UPPER for h in _foreign_attributes(m, ENGINE_INTERNALS)]
    # The simulator drives a scheduler and pool of its own (no engine): those are its objects.
    hits = [h for h in hits if not h.startswith("jupyter_pagedkv/sim/simulator.py")]
    assert not hits, "engine internals used outside core/ and engine/:\n" + "\n".join(hits)


def test_only_core_and_engine_touch_the_schedulers_lists():
    hits = [h for m in MODULES if area(m) not in {"core", "engine"}
            for h in _foreign_attributes(m, SCHEDULER_LISTS)]
    assert not hits, "scheduler queues touched outside core/ and engine/:\n" + "\n".join(hits)


def test_the_local_engine_and_the_server_client_both_satisfy_engine_client():
    from jupyter_pagedkv.engine.engine import Engine
    from jupyter_pagedkv.protocol import EngineClient
    from jupyter_pagedkv.remote.client import RemoteEngine

    wanted = {n for n in dir(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)
    for cls in (Engine, RemoteEngine):
        missing = sorted(n for n in wanted if not hasattr(cls, n) and n != "name")
        assert not missing, f"{cls.__name__} lacks {missing}"


def test_no_stand_ins_and_no_is_remote_branches():
    text = "\n".join(p.read_text() for p in MODULES.values())
    for name in ("is_remote", "_NoBlocks", "ServerTemplate", "RemoteDevice"):
        assert name not in text, f"{name} is back"


def test_files_stay_small_and_the_engine_class_smaller():
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > 450}
    assert not big, f"files over 450 lines: {big}"
    tree = ast.parse(MODULES["jupyter_pagedkv.engine.engine"].read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno < 400
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "config.py", "protocol.py"]


def test_modules_that_catch_broadly_log_what_they_swallow():
    broad = re.compile(r"except( \(?(Exception|BaseException)\b[^:]*)?:")
    quiet = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        text = "\n".join(lines)
        for i, line in enumerate(lines):
            if not broad.search(line):
                continue
            block = []
            indent = len(line) - len(line.lstrip())
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt)
            body = "\n".join(block)
            if "raise" in body or "self._fail(" in body:
                continue                       # re-raised, or handed to the engine's failure path (it logs)
            if "logger." not in body or "logging.getLogger(__name__)" not in text:
                quiet.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not quiet, "broad excepts that swallow without logging:\n" + "\n".join(quiet)


def test_docstrings_and_comments_cite_only_files_the_repository_has():
    cited = re.compile(r"\b((?:docs|kernels|notebooks|tests|mk|labextension)/[\w./-]+\.\w+|[A-Z_]+\.md)\b")
    missing = []
    for path in list(MODULES.values()) + sorted((ROOT / "kernels").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py")):
        for ref in set(cited.findall(path.read_text())):
            if not (ROOT / ref).exists() and not list(ROOT.rglob(ref)):
                missing.append(f"{path.relative_to(ROOT)} cites {ref}")
    assert not missing, "\n".join(missing)
