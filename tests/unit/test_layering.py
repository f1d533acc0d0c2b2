"""The package's import rules, defined here and read from the source: every import
statement counts, module level or inside a function (``TYPE_CHECKING`` blocks too).

The rules are one ordered table of layers, lowest first: a module may import its own
folder and the folders of the layers before its own, never a later one. Each import
that breaks the order today is listed, with its reason, in ``UPWARD``. docs/ARCHITECTURE.md
holds the table rendered by ``layer_rules_markdown``; after changing the rules, print
the new block with ``python tests/unit/test_layering.py`` and put it in the document.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "distzo"
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"

ROOT = "(root)"  # the modules at the package root, the top layer
ROOT_MODULES = ("__init__.py", "train.py", "replay.py")

# (folder, what it holds), lowest first. Why this order: zo, models, objectives and data
# run in any process and know no ranks, so dist sits above them; the engine takes its
# options (ZOConfig) from config and adapters; the job exports what it trained; nothing in
# the package depends on the benchmarks' helpers.
LAYERS = (
    ("runtime", "the process and its device: `to_device`, `device_name`, /proc memory readings"),
    ("zo", "the algorithm: counter-based noise, the estimate of `g`, the lr, moment rules"),
    ("models", "model families (embed, block, head), weight sources, named shapes, the hub"),
    ("objectives", "what a step minimises: one loss per pass, through a `PassRunner`"),
    ("data", "tasks and batches: generated, text and prompt tasks, templates, encoding"),
    ("dist", "the launch, the `dp x pert` layout, process groups and every collective"),
    ("offload", "flat buckets, device slots, block stores, streams and their schedule"),
    ("adapters", "peft adapters: specification, attaching, their weights, prefix tables"),
    ("config", "options: the engine's `ZOConfig`, the job's option tree, command-line errors"),
    ("engine", "the step: `ZOEngine` and what it is built from"),
    ("export", "the Hugging Face directory and the `torch.export` training step"),
    ("job", "the training job: checkpoints, evaluation, seed log, memory plan, reporting"),
    ("bench", "timing, the report schema and the peer protocol of the scripts in `benchmarks/`"),
    (ROOT, "`__init__.py` (the public names), `train.py` and `replay.py` (the commands)"),
)

# Folders under distzo/ that hold no Python and so no imports.
NOT_PYTHON = {"csrc": "the C source of the CPU noise kernel, built into `distzo.zo._philox_noise`"}

# (importing module, imported module of a higher layer): why. Empty today; an entry must
# still be needed (the test fails once one is gone), so the list only shrinks.
UPWARD: dict[tuple[str, str], str] = {}

RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layer_of_module(module: str) -> str:
    """The layer of a module given by its path under distzo/ (``zo/noise.py``)."""
    parts = Path(module).parts
    return parts[0] if len(parts) > 1 else ROOT


def layer_of_import(name: str) -> str:
    """The layer of an imported ``distzo`` name: its folder, or the root for ``distzo``
    itself, its root modules and the names ``distzo/__init__.py`` exports."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else ROOT


def python_modules() -> list[str]:
    return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))


def upward_imports() -> dict[str, list[str]]:
    """Per module, the distzo imports of a layer later than its own (exceptions included)."""
    found: dict[str, list[str]] = {}
    for module in python_modules():
        rank = RANK[layer_of_module(module)]
        names = {
            name
            for name in imported_modules(PACKAGE / module)
            if name.split(".")[0] == "distzo" and RANK[layer_of_import(name)] > rank
        }
        # `from a.b import c` also names a.b.c: keep the module, not each name from it
        names = {n for n in names if not any(n.startswith(m + ".") for m in names)}
        if names:
            found[module] = sorted(names)
    return found


def within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def excused(module: str, name: str) -> bool:
    return any(module == importer and within(name, imported) for importer, imported in UPWARD)


def layer_rules_markdown() -> str:
    """The rules as docs/ARCHITECTURE.md states them."""
    lines = [
        "<!-- generated by tests/unit/test_layering.py: edit the rules there -->",
        "| layer | package | holds | may import |",
        "|---|---|---|---|",
    ]
    for rank, (name, holds) in enumerate(LAYERS, start=1):
        package = "`distzo/*.py`" if name == ROOT else f"`distzo/{name}/`"
        below = {1: "nothing else of distzo", 2: "layer 1"}.get(rank, f"layers 1-{rank - 1}")
        lines.append(f"| {rank} | {package} | {holds} | {below} |")
    lines.append("")
    for name, holds in NOT_PYTHON.items():
        lines.append(f"`distzo/{name}/` holds no Python: {holds}.")
    lines.append("")
    if not UPWARD:
        lines.append("No module imports a higher layer.")
    else:
        lines.append("Imports of a higher layer today, each one named:")
        lines.append("")
    for (importer, imported), why in UPWARD.items():
        layer = layer_of_import(imported)
        lines.append(
            f"* `distzo/{importer}` imports `{imported}` (layer {RANK[layer] + 1}): {why}."
        )
    lines.append("<!-- end of generated block -->")
    return "\n".join(lines) + "\n"


def test_every_folder_is_placed_in_the_table():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    placed = set(RANK) - {ROOT}
    assert folders - placed - set(NOT_PYTHON) == set(), "place the new folder in LAYERS"
    assert placed | set(NOT_PYTHON) <= folders, "a folder of LAYERS no longer exists"
    for name in NOT_PYTHON:
        assert not list((PACKAGE / name).rglob("*.py")), f"distzo/{name}/ holds Python"


def test_no_module_sits_loose_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == sorted(ROOT_MODULES), "a module belongs in a folder of LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    offenders = {
        module: unexcused
        for module, names in upward_imports().items()
        if (unexcused := [n for n in names if not excused(module, n)])
    }
    assert not offenders, offenders


def test_every_listed_exception_is_still_needed():
    found = upward_imports()
    stale = [
        (importer, imported)
        for importer, imported in UPWARD
        if not any(within(name, imported) for name in found.get(importer, []))
    ]
    assert not stale, f"remove from UPWARD (and docs/ARCHITECTURE.md): {stale}"


def test_the_architecture_document_states_these_rules():
    assert layer_rules_markdown() in ARCHITECTURE.read_text(), (
        "docs/ARCHITECTURE.md does not hold the rules of tests/unit/test_layering.py: "
        "replace its generated block with the output of `python tests/unit/test_layering.py`"
    )


def map_sections() -> dict[str, str]:
    """docs/ARCHITECTURE.md's paragraph on each package (``**`distzo/zo/`**, ...``), by
    layer name; the root's is ``**The root**``."""
    text = ARCHITECTURE.read_text().split("## Packages and modules", 1)[1]
    text = text.split("\n## ", 1)[0]
    sections: dict[str, str] = {}
    for part in re.split(r"^\*\*", text, flags=re.M)[1:]:
        head = re.match(r"`distzo/(\w+)/`\*\*|The root\*\*", part)
        if head:
            sections[head.group(1) or ROOT] = part
    return sections


def test_the_architecture_map_names_every_module_under_its_package():
    """The map lists every module in its package's paragraph, so a new module comes with
    its line and a moved one is not left under its old package."""
    sections = map_sections()
    unnamed = [
        module
        for module in python_modules()
        if not module.endswith("__init__.py") or layer_of_module(module) == ROOT
        if f"`{Path(module).name}`" not in sections.get(layer_of_module(module), "")
    ]
    assert not unnamed, f"name these in docs/ARCHITECTURE.md's packages and modules: {unnamed}"


def test_every_import_is_absolute():
    """A relative import (``from ..engine import x``) would slip past the names checked."""
    relative = [
        f"{module}:{node.lineno}"
        for module in python_modules()
        for node in ast.walk(ast.parse((PACKAGE / module).read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, relative


def test_the_checker_sees_imports_inside_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from distzo.engine import ZOEngine\n")
    assert "distzo.engine" in imported_modules(probe)


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check itself: a zo module that imports the engine inside a function fails."""
    (tmp_path / "zo").mkdir()
    (tmp_path / "zo" / "probe.py").write_text("def f():\n    from distzo.engine import ZOEngine\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "ok.py").write_text("from distzo.zo.noise import NoiseSource\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    assert upward_imports() == {"zo/probe.py": ["distzo.engine"]}


if __name__ == "__main__":
    print(layer_rules_markdown(), end="")
