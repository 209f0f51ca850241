"""The module graph, read from the source with ``ast``: no import cycles (lazy imports
inside functions included), no private name of one module imported or reached into by
another, and the layers in their order (the leaf value types below everything, the core
free of the framework plugins and of Django, Flask and redis at module level)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: (source directory, the package name it is imported as)
PACKAGES = (
    (ROOT / "gatekeeper_wsgi", "gatekeeper_wsgi"),
    (ROOT / "contrib", "gatekeeper_wsgi.contrib"),
)
#: What the leaf modules may import of the package: nothing but other leaves.
LEAVES: dict[str, frozenset[str]] = {
    "gatekeeper_wsgi.adaptive": frozenset(),
    "gatekeeper_wsgi.redact": frozenset(),
    "gatekeeper_wsgi.limitindex": frozenset({"gatekeeper_wsgi.values"}),
    "gatekeeper_wsgi.access": frozenset({"gatekeeper_wsgi.redact"}),
    "gatekeeper_wsgi.naming": frozenset(),
    "gatekeeper_wsgi.monitor": frozenset({"gatekeeper_wsgi.adaptive"}),
    "gatekeeper_wsgi.values": frozenset({"gatekeeper_wsgi.adaptive", "gatekeeper_wsgi.redact"}),
    "gatekeeper_wsgi.errors": frozenset({"gatekeeper_wsgi.values"}),
    "gatekeeper_wsgi.requestvalues": frozenset({"gatekeeper_wsgi.values"}),
    "gatekeeper_wsgi.turns": frozenset(),
    "gatekeeper_wsgi.forks": frozenset(),
}
FRAMEWORKS = ("django", "flask", "redis")


@dataclass(frozen=True)
class Import:
    module: str  #: the importing module
    target: str  #: the module imported (a package module when a name of it is imported)
    names: tuple[str, ...]  #: names imported from it (empty for ``import x``)
    line: int
    top_level: bool  #: at module level (not inside a function, not ``TYPE_CHECKING``)


def _modules() -> dict[str, Path]:
    found = {}
    for directory, package in PACKAGES:
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, top_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``node`` with whether it runs when the module is imported.
    ``if TYPE_CHECKING:`` blocks are left out: they never run, so they load nothing."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other, top_level
                yield from _walk(other, top_level)
            continue
        inner = top_level and not isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        yield child, inner
        yield from _walk(child, inner)


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node, top_level in _walk(tree, True):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, (), node.lineno, top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = tuple(alias.name for alias in node.names)
            # `from package import submodule` imports the submodule.
            for name in names:
                if f"{target}.{name}" in MODULES:
                    found.append(Import(module, f"{target}.{name}", (), node.lineno, top_level))
            found.append(Import(module, target, names, node.lineno, top_level))
    return found


IMPORTS = [each for module, path in MODULES.items() for each in _imports(module, path)]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for each in IMPORTS:
        if each.target in MODULES and each.target != each.module:
            graph[each.module].add(each.target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_the_package() -> None:
    """The graph covers the core, the backends and both plugins, with their imports."""
    assert {"gatekeeper_wsgi.engine", "gatekeeper_wsgi.backends.memory"} <= MODULES.keys()
    assert "gatekeeper_wsgi.contrib.django.middleware" in MODULES
    assert "gatekeeper_wsgi.kernel" in _graph()["gatekeeper_wsgi.middleware"]


def test_the_checker_finds_a_cycle() -> None:
    """A cycle of three modules, and one through a lazy import, are both reported."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    source = "def f():\n    from gatekeeper_wsgi import engine\n"
    tree = ast.parse(source)
    lazy = [node for node, top in _walk(tree, True) if isinstance(node, ast.ImportFrom)]
    assert lazy and not any(top for node, top in _walk(tree, True) if node is lazy[0])


def test_no_import_cycles() -> None:
    """No module imports itself through others, not even by a lazy import in a function."""
    assert _cycles(_graph()) == []


def test_no_private_names_imported() -> None:
    """No module imports a ``_private`` name from another module of the package."""
    found = [
        f"{each.module}:{each.line} imports {each.target}.{name}"
        for each in IMPORTS
        if each.target.startswith("gatekeeper_wsgi")
        for name in each.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert found == []


def _own_private_names(tree: ast.AST) -> set[str]:
    """The ``_private`` attributes a module defines: functions, classes, slots and
    attributes it assigns on ``self``/``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__" and isinstance(node.value, ast.Tuple | ast.List):
                        names.update(
                            e.value for e in node.value.elts if isinstance(e, ast.Constant)
                        )
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_private_attributes_reached_into() -> None:
    """No module reads ``obj._private`` where only another module of the package defines
    that private name (e.g. the middleware calling the engine's ``_admit``): the owner
    offers a method instead. Framework privates (Django's ``_container``) are not ours."""
    trees = {
        module: ast.parse(path.read_text(encoding="utf-8")) for module, path in MODULES.items()
    }
    owned = {module: _own_private_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(names for other, names in owned.items() if other != module))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or node.attr in owned[module]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in others:
                found.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    assert found == []


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_import_only_leaves(leaf: str) -> None:
    """The leaf modules (shared value types, errors, redaction, the limit index...)
    import nothing of the package above them, so every layer can import them."""
    imported = {
        each.target
        for each in IMPORTS
        if each.module == leaf and each.target.startswith("gatekeeper_wsgi")
    }
    assert imported <= LEAVES[leaf]


def test_the_core_never_imports_the_plugins() -> None:
    """``gatekeeper_wsgi`` (the core) imports nothing of ``contrib``: plugins build on it."""
    found = [
        f"{each.module}:{each.line} imports {each.target}"
        for each in IMPORTS
        if not each.module.startswith("gatekeeper_wsgi.contrib")
        and each.target.startswith("gatekeeper_wsgi.contrib")
    ]
    assert found == []


def test_the_core_imports_no_framework_at_module_level() -> None:
    """The core imports Django, Flask and redis-py only where they are used (inside the
    function or the lazily loaded backend module), so it runs without them installed."""
    lazily_loaded = {"gatekeeper_wsgi.backends.redis"}
    found = [
        f"{each.module}:{each.line} imports {each.target}"
        for each in IMPORTS
        if each.top_level
        and not each.module.startswith("gatekeeper_wsgi.contrib")
        and each.module not in lazily_loaded
        and each.target.split(".")[0] in FRAMEWORKS
    ]
    assert found == []


def test_both_middlewares_are_clients_of_the_kernel() -> None:
    """The WSGI and the Django middleware both build on the integration kernel's Gate and
    ResponseWatch; neither reaches past it into the engine's admission."""
    graph = _graph()
    for client in ("gatekeeper_wsgi.middleware", "gatekeeper_wsgi.contrib.django.middleware"):
        assert "gatekeeper_wsgi.kernel" in graph[client]
        names = {
            name
            for each in IMPORTS
            if each.module == client and each.target == "gatekeeper_wsgi.kernel"
            for name in each.names
        }
        assert {"Gate", "ResponseWatch"} <= names
