"""The layout limits every change keeps (issue 27, docs/testing.md "Code limits"):

* no file in ``numkern/`` or ``engine/`` over 900 lines;
* no call with more than 16 positional arguments, nor a ``*``-unpacked call with more
  than 8 positional arguments before the star (a wall of arguments matched by count);
* no import circle among numkern's and engine's modules, counting imports inside
  functions (a circle hidden in a function is still one);
* the engine imports no numkern private: no ``numkern._x`` module, no ``_name`` from a
  numkern module, no ``alias._name`` on a numkern module it imported.

Read from the source with :mod:`ast`; nothing is imported or run.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("numkern", "engine")
MAX_LINES = 900
MAX_POSITIONAL = 16
MAX_BEFORE_STAR = 8


def _modules():
    """``{dotted name: path}`` of every module of the two packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _absolute(module, path, node):
    """The dotted module a ``from ... import`` names, relative levels resolved."""
    if node.level == 0:
        return node.module
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module, path):
    """``[(imported module, names or None, line)]`` of every import in ``module``."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((_absolute(module, path, node), [a.name for a in node.names], node.lineno))
    return out


def _edges(module, path):
    """The modules of the two packages that ``module`` imports: ``from pkg import sub``
    is an edge to ``pkg.sub`` when ``sub`` is a module, else to ``pkg``."""
    edges = set()
    for target, names, _ in _imports(module, path):
        if names is None:
            if target in MODULES:
                edges.add(target)
            continue
        for name in names:
            sub = f"{target}.{name}"
            if sub in MODULES:
                edges.add(sub)
            elif target in MODULES:
                edges.add(target)
    edges.discard(module)
    return edges


def _circles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_package_parent(a, b):
    """``a`` is a package that ``b`` lives in (importing a package runs its __init__,
    which may import its own submodules: that is loading order, not a circle)."""
    return b.startswith(a + ".")


def test_no_file_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _walls(paths):
    """``["path:line: why"]`` of the calls past the positional-argument limits."""
    walls = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            stars = [i for i, a in enumerate(node.args) if isinstance(a, ast.Starred)]
            where = f"{path.relative_to(path.parents[1])}:{node.lineno}"
            if stars and stars[0] > MAX_BEFORE_STAR:
                walls.append(f"{where}: {stars[0]} positional before *")
            elif not stars and len(node.args) > MAX_POSITIONAL:
                walls.append(f"{where}: {len(node.args)} positional")
    return walls


def test_no_wall_of_positional_arguments():
    walls = _walls(MODULES.values())
    assert not walls, "calls past the positional-argument limits:\n" + "\n".join(walls)


def test_no_import_circle():
    graph = {
        m: {t for t in _edges(m, p) if not _is_package_parent(t, m)} for m, p in MODULES.items()
    }
    assert _circles(graph) == []


def test_engine_imports_no_numkern_private():
    found = []
    for module, path in MODULES.items():
        if not module.startswith("engine"):
            continue
        aliases = set()
        for target, names, line in _imports(module, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if not (target == "numkern" or target.startswith("numkern.")):
                continue
            if any(part.startswith("_") for part in target.split(".")):
                found.append(f"{where}: module {target}")
            for name in names or ():
                if name.startswith("_"):
                    found.append(f"{where}: {target}.{name}")
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(
                    a.asname or a.name for a in node.names if a.name.startswith("numkern")
                )
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numkern"):
                aliases.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "the engine reaches numkern privates:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, walls",
    [
        ("f(" + ", ".join(["a"] * 17) + ")", 1),
        ("f(" + ", ".join(["a"] * 16) + ")", 0),
        ("f(" + ", ".join(["a"] * 9) + ", *b)", 1),
        ("f(" + ", ".join(["a"] * 8) + ", *b, " + ", ".join(["a"] * 20) + ")", 0),
    ],
)
def test_the_argument_check_counts(source, walls, tmp_path):
    """The wall check itself sees a wall (a check that cannot fail tests nothing)."""
    path = tmp_path / "pkg" / "m.py"
    path.parent.mkdir()
    path.write_text(source + "\n")
    assert len(_walls([path])) == walls


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
