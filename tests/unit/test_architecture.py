"""The shape of the code, checked: state has one owner (no module assigns another object's
attributes), every function stays simple enough to read top-down, the commands that need no mount
import no FUSE, neither engine imports the other, and the README's module table names every
module (sub-packages included)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lizard
from radon.complexity import cc_visit

from tests.helpers import ROOT

PACKAGE = ROOT / "colifs"
MAX_COMPLEXITY = 15  # cyclomatic complexity (radon for Python, lizard for C): every function below it
# Objects filled field by field because their type offers nothing else: pyfuse3's reply structs,
# the stdlib logger's configuration.
ALLOWED = {("pyfuse3/fs.py", "e"), ("pyfuse3/fs.py", "out"), ("logs.py", "log")}
MUTATORS = {"append", "extend", "add", "update", "pop", "discard", "clear", "setdefault", "remove", "insert"}


def _base(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _foreign(target: ast.expr) -> str | None:
    """The name whose attribute `target` writes, unless it is the object's own (self, cls)."""
    if isinstance(target, ast.Subscript):
        target = target.value
        while isinstance(target, ast.Subscript):
            target = target.value
    if not isinstance(target, ast.Attribute):
        return None
    base = _base(target)
    if isinstance(base, ast.Name) and base.id in ("self", "cls"):
        return None
    return ast.unparse(base)


def _writes(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(node.func.value, ast.Attribute)
        ):
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.expr) and (who := _foreign(part)) is not None:
                    yield node.lineno, who, ast.unparse(part)


def modules() -> list[Path]:
    """Every module of the package, sub-packages included."""
    return sorted(PACKAGE.rglob("*.py"))


def name(path: Path) -> str:
    """`pyfuse3/fs.py`: a module's path inside the package."""
    return path.relative_to(PACKAGE).as_posix()


def test_no_module_assigns_another_objects_attributes() -> None:
    found = []
    for path in modules():
        for line, who, what in _writes(ast.parse(path.read_text())):
            if (name(path), who) not in ALLOWED:
                found.append(f"{name(path)}:{line}: {what}")
    assert not found, "state written from outside its owner (give the owner a method):\n" + "\n".join(found)


def test_the_check_sees_an_outside_assignment() -> None:
    code = "def f(stats, of):\n    stats.usage = 1\n    of.fds[0] = 2\n    of.seen.add(3)\n    self.x = 4\n"
    assert [w for _, w, _ in _writes(ast.parse(code))] == ["stats", "of", "of"]


def test_every_function_is_simple_enough() -> None:
    complex_ = []
    for path in [*modules(), *sorted((ROOT / "contrib").rglob("*.py"))]:
        for block in cc_visit(path.read_text()):
            for fn in [block, *getattr(block, "methods", [])]:
                if fn.complexity >= MAX_COMPLEXITY:
                    complex_.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {fn.complexity}")
    for path in sorted((ROOT / "native").glob("*.[ch]")):  # the native engine, by lizard's count
        for fn in lizard.analyze_file(str(path)).function_list:
            if fn.cyclomatic_complexity >= MAX_COMPLEXITY:
                complex_.append(
                    f"{path.relative_to(ROOT)}:{fn.start_line} {fn.name}: {fn.cyclomatic_complexity}"
                )
    assert not complex_, f"complexity {MAX_COMPLEXITY} or more:\n" + "\n".join(sorted(set(complex_)))


def loaded(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter has loaded after `import {imports}`."""
    code = f"import sys, {imports}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip())


def test_commands_without_a_mount_import_no_fuse() -> None:
    """plan, stage, verify, probe, stats, route, top: quick to start, usable without libfuse."""
    commands = (
        "colifs.cli, colifs.plan, colifs.stage, colifs.verify, colifs.probe, colifs.client, "
        "colifs.tables, colifs.catalogue, colifs.checks, colifs.config, colifs.top, colifs.metrics"
    )
    assert loaded(commands, ("pyfuse3", "trio", "colifs._native")) == []


def test_mounting_imports_none_of_the_mirror_tools() -> None:
    """A mount reads the receipt (colifs.receipt) but never loads plan, stage or verify."""
    mount = "colifs.mount, colifs.assemble, colifs.native, colifs.pyfuse3.engine"
    assert loaded(mount, ("colifs.plan", "colifs.stage", "colifs.verify", "colifs.progress")) == []


def imported(path: Path) -> set[str]:
    """The colifs modules `path` imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("colifs")}


def test_neither_engine_imports_the_other_and_the_mirror_policy_neither() -> None:
    """What both engines use lives in neutral modules (backing, mirrors, namespace, ...)."""
    native = {"colifs.native", "colifs._native"}
    found = []
    for path in modules():
        uses = imported(path)
        if name(path).startswith("pyfuse3/") and uses & native:
            found.append(f"{name(path)} imports the native engine: {sorted(uses & native)}")
        if name(path) in ("native.py", "mirrors.py") and any(m.startswith("colifs.pyfuse3") for m in uses):
            found.append(f"{name(path)} imports the pyfuse3 engine")
        if name(path) == "mirrors.py" and uses & native:
            found.append("mirrors.py imports the native engine")
    assert not found, "\n".join(found)


def _docstring_only(path: Path) -> bool:
    """A package's `__init__.py` that only says what the package is."""
    return len(ast.parse(path.read_text()).body) <= 1


def test_the_readme_module_table_names_every_module() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(?:colifs/)?((?:\w+/)?\w+\.py)`", section))
    every = {name(p) for p in modules() if not _docstring_only(p)} - {"__init__.py", "__main__.py"}
    assert every <= listed, f"not in the README's module table: {sorted(every - listed)}"
