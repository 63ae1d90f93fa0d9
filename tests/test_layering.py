"""The package's layers only point down, and no import closes a circle.

Order (README, Layout; each package imports only those before it): config, parallel, models, data,
optim, checkpoint, hf, logging, training, rehearse, estimate, runtime, launch, commands. Read from
the source with ``ast`` — every import statement, at module level or inside a function, since a
function-local import is still a dependency (and one placed to dodge a cycle is exactly what this
test is for). Within a package the modules may import each other, but never in a circle: a
package's ``__init__`` re-exporting its modules is the one edge that may point back (``from pkg
import X`` inside ``pkg.mod`` reads ``pkg/__init__.py`` only once ``pkg.mod`` is done, which Python
resolves), so ``__init__`` modules are left out of the circle search.

The tests follow one rule of their own: shared test helpers live in the package ``tests/helpers``
(imported as ``helpers.xxx``), and no test module imports another test module.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from nanotrain import LAYERS as ORDER

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanotrain"
TESTS = ROOT / "tests"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def imports() -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported nanotrain module, line)], resolving ``from pkg import name`` to the
    submodule ``pkg.name`` when it exists."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names if a.name.startswith("nanotrain")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanotrain"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.append((sub if sub in modules else node.module, node.lineno))
        out[name] = found
    return out


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_layer():
    strays = [m for m in imports() if m != "nanotrain" and layer(m) not in ORDER]
    assert not strays, f"modules outside the layers {ORDER}: {strays}"


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in imports().items():
        src = layer(module)
        for target, line in targets:
            dst = layer(target)
            if src and dst and src != dst and ORDER.index(dst) > ORDER.index(src):
                upward.append(f"{module}:{line} imports {target} ({dst} is above {src})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_closes_a_circle():
    known = imports()
    graph = {m: {t for t, _ in targets if t in known} for m, targets in known.items()}
    packages = {m for m in graph if (PACKAGE.parent / (m.replace(".", "/") + "/__init__.py")).is_file()}
    graph = {m: {t for t in ts if t not in packages and t != m} for m, ts in graph.items() if m not in packages}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(
                    " -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_test_module_imports_another():
    """Importing a test module runs its module-level code and makes its internals a hidden
    dependency of another file (rename one and an unrelated test breaks): what test modules
    share belongs in tests/helpers/."""
    offenders = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0].startswith("test_"):
                    offenders.append(f"tests/{path.name}:{node.lineno} imports {name}")
    assert not offenders, (
        "test modules that import another test module (move what they share into "
        "tests/helpers/):\n" + "\n".join(offenders)
    )
