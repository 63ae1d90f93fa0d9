"""Print nanotrain's package import graph: which layer imports which, read from the source (ast).

    python scripts/import_graph.py            # one line per package: what it imports
    python scripts/import_graph.py --modules  # the module-level edges that cross packages

The layers, bottom up: config, parallel, models, data, optim, checkpoint, hf, logging, training,
rehearse, estimate, runtime, launch, commands (tests/test_layering.py holds the same list). An edge
that points up this list is marked `UP` (tests/test_layering.py fails on it).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanotrain import LAYERS as ORDER  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402


def edges() -> dict[tuple[str, str], set[str]]:
    """(importing module, imported nanotrain module) for every import statement in the package."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted((ROOT / "nanotrain").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            for name in names:
                if name.startswith("nanotrain."):
                    out[(module, name)].add(str(node.lineno))
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(top)"


def main(argv: list[str] | None = None) -> int:
    return answer(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="module-level edges across packages")
    opts = parser.parse_args(argv)
    packages: dict[str, set[str]] = defaultdict(set)
    for (src, dst), lines in sorted(edges().items()):
        a, b = layer(src), layer(dst)
        if a == b:
            continue
        up = a in ORDER and b in ORDER and ORDER.index(b) > ORDER.index(a)
        packages[a].add(b + (" UP" if up else ""))
        if opts.modules:
            print(f"{src} -> {dst} (line {', '.join(sorted(lines, key=int))}){'  UP' if up else ''}")
    if not opts.modules:
        for name in sorted(packages, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)):
            print(f"{name:>10} -> {', '.join(sorted(packages[name]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
