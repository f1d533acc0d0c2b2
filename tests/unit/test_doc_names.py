"""The docs name code that exists: every backticked symbol, flag and file path of
docs/ARCHITECTURE.md and docs/python-api.md is checked against the repository, so that a
rename or a removal cannot leave the map pointing at nothing.

What counts as a name, kept simple (a span is the text between two backticks, fenced code
blocks left out):

* a flag: each ``--name`` in a span, one of the options of ``distzo.train`` (its real
  parser) or of an ``add_argument`` call in distzo/ or benchmarks/ (replay, plan_report,
  the exported step, the benchmarks);
* a path: a span of path characters that holds a ``/`` or ends in ``.py``: a file or
  folder of the repository, matched from the root or as the tail of one (``scheduler.py``,
  ``engine/parts.py``, ``estimators/``); a ``*`` is a glob;
* a symbol: a span that is one name, dotted or not, maybe followed by a call's ``(...)``
  or ``=value``, and that looks like code (an underscore, a dot, a call or CamelCase: a
  plain lowercase word may be an option value such as ``auto``). ``Class.member`` must be
  a member of that class (or of a base it names), and so must ``engine.step`` and the
  other values of ``VALUES``; ``distzo.a.b`` a module or a top-level name of one;
  ``torch.x``, ``dcp.async_save`` (a root distzo imports) what distzo spells so or what
  imports; ``module.name``, a top-level name of that module. Any other name (of a dotted
  one its last part: in ``parts.scratch_sizes`` a module's name is a variable's too) must
  be bound in distzo/'s source (def, class, parameter, assignment, attribute set or read,
  import, call keyword), written there as a string (a record key, an environment variable,
  a module's name), or be a builtin.

A name the docs give that is not in the repository (a run directory's entries, notation)
is listed, with why, in ``NOT_IN_REPOSITORY``; keep it short: a long list means the rule
that picks names is too wide.
"""

import ast
import builtins
import fnmatch
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("docs/ARCHITECTURE.md", "docs/python-api.md")
PATH_ROOTS = ("distzo", "benchmarks", "tests", "docs")  # where a named file may be

NAME = r"[A-Za-z_]\w*"
SPAN = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
PATH = re.compile(r"[\w.*-]+(/[\w.*-]+)*/?")
SYMBOL = re.compile(rf"(?P<name>{NAME}(\.{NAME})*)(?P<call>\(.*\))?(=\S+)?")
CAMEL = re.compile(r"[A-Z].*[a-z]|[a-z].*[A-Z]")
# A dotted name that ends like this is a file a run writes (summary.json), not code.
FILE_SUFFIXES = ("json", "jsonl", "toml", "png", "md", "txt", "safetensors", "tmp")

# The docs' names for values of the package's classes: `engine.step` is `ZOEngine.step`.
VALUES = {
    "engine": "ZOEngine",
    "trainer": "Trainer",
    "runner": "PassRunner",
    "parallel": "ParallelContext",
}

# Spans that look like code or a path but name something outside the repository.
NOT_IN_REPOSITORY = {
    # entries of a run directory or of a checkpoint, written by a run
    "step-N/": "a checkpoint's folder",
    "step-N.tmp/": "a checkpoint being written",
    "export-best/": "the best evaluation's export",
    "base/": "the export's base model folder",
    "meta/*": "a checkpoint's metadata keys",
    "meta/lowrank": "a checkpoint's metadata key",
    "block/i": "a checkpoint's key of block i",
    # notation of the math, not code
    "z_0": "the first perturbation",
    "c_j": "the coefficient of perturbation j",
    "g_j": "the projected gradient of perturbation j",
    "P(K)": "the period of the block schedule's model",
}


def doc_spans(doc: str) -> list[str]:
    return SPAN.findall(FENCED.sub("", (REPO / doc).read_text()))


def is_path(span: str) -> bool:
    return bool(PATH.fullmatch(span)) and ("/" in span or span.endswith(".py"))


def names_of_code(span: str) -> str | None:
    """The dotted name a span gives as code, or None where it is not one."""
    m = SYMBOL.fullmatch(span)
    if not m or m["name"].rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None
    name = m["name"]
    looks_like_code = m["call"] or "_" in name or "." in name or CAMEL.search(name)
    return name if looks_like_code else None


class SourceNames:
    """What the source binds: every name, and per class and per module its own."""

    def __init__(self) -> None:
        self.bound: set[str] = set(dir(builtins))
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}
        self.modules: dict[str, set[str]] = {}
        self.imported: dict[str, str] = {}  # what a name bound by an import stands for
        self.chains: set[str] = set()  # dotted names the source spells: `dcp.async_save`
        for path in (REPO / "distzo").rglob("*.py"):
            self._read(path)
        self.spelled = {self.resolved(c) for c in self.chains} | set(self.imported.values())

    def resolved(self, dotted: str) -> str:
        """``dcp.async_save`` as ``torch.distributed.checkpoint.async_save``."""
        first, _, rest = dotted.partition(".")
        full = self.imported.get(first, first)
        return f"{full}.{rest}" if rest else full

    def _read(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        module = self.modules.setdefault(path.stem, set())
        module.update(_bound_at_top(tree.body))
        self.bound.add(path.stem)
        for node in ast.walk(tree):
            self.bound.update(_bound_by(node))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._note_imports(node)
            elif isinstance(node, ast.Attribute) and (chain := _dotted(node)):
                self.chains.add(chain)
            if isinstance(node, ast.ClassDef):
                members = self.members.setdefault(node.name, set())
                members.update(_bound_at_top(node.body))
                members.update(
                    sub.attr
                    for sub in ast.walk(node)
                    if isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                )
                self.bases.setdefault(node.name, set()).update(
                    ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases
                )

    def _note_imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.ImportFrom) and (node.level or node.module is None):
            return
        for alias in node.names:
            if isinstance(node, ast.ImportFrom):
                self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif alias.asname:
                self.imported[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.imported[root] = root

    def class_has(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member in self.members.get(cls, ()):
            return True
        return any(
            self.class_has(base, member, seen | {cls})
            for base in self.bases.get(cls, ())
            if base not in seen
        )


def _bound_at_top(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(n for alias in node.names for n in _bound_by(alias))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (value := _dotted(node.value)):
        return f"{value}.{node.attr}"
    return None


def _bound_by(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.keyword) and node.arg:
        return {node.arg}
    if isinstance(node, ast.alias):
        return {node.asname or node.name.rsplit(".", 1)[-1]}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    if isinstance(node, ast.Attribute):  # set, or read: `save_pretrained`, `project_in`
        return {node.attr}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} if re.fullmatch(rf"{NAME}(\.{NAME})*", node.value) else set()
    return set()


@cache
def source_names() -> SourceNames:
    return SourceNames()


def resolves_in_distzo(dotted: list[str]) -> bool:
    """``distzo.a.b.c``: a module path, then names bound at the top of that module."""
    path = REPO / "distzo"
    rest = dotted[1:]
    while rest and ((path / rest[0]).is_dir() or (path / f"{rest[0]}.py").is_file()):
        path, rest = path / rest[0], rest[1:]
    module = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return not rest or rest[0] in _bound_at_top(ast.parse(module.read_text()).body)


def resolves_by_import(dotted: list[str]) -> bool:
    """``torch.where``, ``statistics.NormalDist``: the name imports."""
    for cut in range(len(dotted), 0, -1):
        try:
            found: object = importlib.import_module(".".join(dotted[:cut]))
        except ImportError:
            continue
        for part in dotted[cut:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def symbol_exists(name: str) -> bool:
    names = source_names()
    first, *rest = dotted = name.split(".")
    if name in names.bound:  # rest or not: `distzo.zo._philox_noise` is a built module's
        return True
    if first == "distzo":
        return resolves_in_distzo(dotted)
    if not rest:
        return False
    if first in names.members or first in VALUES:
        return names.class_has(VALUES.get(first, first), rest[0])
    if first in names.modules and rest[0] in names.modules[first]:
        return True
    if first in names.imported:  # `torch.where`, `nn.Linear` (from torch import nn)
        full = names.resolved(name)
        return full in names.spelled or resolves_by_import(full.split("."))
    return rest[-1] in names.bound  # an attribute of a value: `runner.head`, `trainer.step`


@cache
def repository_tails() -> frozenset[str]:
    """Every file and folder of the repository's code, tests and docs, by each tail of its
    path: ``distzo/engine/parts.py`` gives ``engine/parts.py`` and ``parts.py`` too."""
    tails = {p.name for p in REPO.iterdir()}
    for top in PATH_ROOTS:
        for path in (REPO / top).rglob("*"):
            parts = path.relative_to(REPO).parts
            tails.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(tails)


def path_exists(span: str) -> bool:
    """From the root or as the tail of a path (``engine/parts.py``); ``*`` globs."""
    path = span.rstrip("/")
    return path in repository_tails() or bool(fnmatch.filter(repository_tails(), path))


@cache
def known_flags() -> frozenset[str]:
    """distzo.train's flags from its parser; every other command's from its source."""
    from distzo.config.job import build_parser

    flags = set(build_parser()._option_string_actions)
    for top in ("distzo", "benchmarks"):
        for path in (REPO / top).rglob("*.py"):
            flags.update(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))
    return frozenset(flags)


def stale_names(doc: str) -> tuple[int, list[str]]:
    """How many names ``doc`` gives, and those that point at nothing."""
    checked, stale = 0, []
    for span in doc_spans(doc):
        if span in NOT_IN_REPOSITORY:
            continue
        for flag in FLAG.findall(span):
            checked += 1
            if flag not in known_flags():
                stale.append(f"flag {flag}")
        if span.startswith("--"):
            continue
        if is_path(span):
            checked += 1
            if not path_exists(span):
                stale.append(f"path {span}")
        elif (name := names_of_code(span)) is not None:
            checked += 1
            if not symbol_exists(name):
                stale.append(f"symbol {span}")
    return checked, sorted(set(stale))


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_doc_gives_exists(doc):
    checked, stale = stale_names(doc)
    assert checked > 50, f"{doc}: the extraction found only {checked} names"
    assert not stale, f"{doc} names what the repository no longer has: {stale}"


def test_every_name_let_through_is_still_needed():
    """Each entry is still in a doc, and would fail the checks: the list only shrinks."""
    spans = {span for doc in DOCS for span in doc_spans(doc)}
    assert set(NOT_IN_REPOSITORY) <= spans, set(NOT_IN_REPOSITORY) - spans
    passing = [
        span
        for span in NOT_IN_REPOSITORY
        if (is_path(span) and path_exists(span))
        or (not is_path(span) and symbol_exists(names_of_code(span) or ""))
    ]
    assert not passing, f"remove from NOT_IN_REPOSITORY: {passing}"
