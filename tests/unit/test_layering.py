"""The package's import rules (docs/ARCHITECTURE.md, section 16), read from the source:
every import statement counts, module level or inside a function."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "distzo"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def distzo_imports(folder: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(PACKAGE)): {
            n for n in imported_modules(path) if n.startswith("distzo")
        }
        for path in sorted((PACKAGE / folder).rglob("*.py"))
    }


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        (
            "data",
            ("distzo.engine.engine", "distzo.job.evaluation", "distzo.train"),
        ),  # data knows no engine
        (
            "objectives",
            (
                "distzo.engine.engine",
                "distzo.job.evaluation",
                "distzo.data",
                "distzo.offload",
                "distzo.dist",
            ),
        ),
        (
            "zo",
            (
                "distzo.engine.engine",
                "distzo.data",
                "distzo.offload",
                "distzo.dist",
                "distzo.objectives",
            ),
        ),
    ],
)
def test_a_lower_layer_imports_nothing_above_it(folder, forbidden):
    offenders = {
        module: sorted(n for n in names if n.startswith(forbidden))
        for module, names in distzo_imports(folder).items()
    }
    assert not {m: n for m, n in offenders.items() if n}, offenders


def test_the_checker_sees_imports_inside_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from distzo.engine import ZOEngine\n")
    assert "distzo.engine.engine" in imported_modules(probe)
