"""The lint rules the code's `noqa` comments assume (pyproject.toml's [tool.ruff]) hold."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """The stallfree modules `path` imports, at its top or inside functions (not the ones
    under `if TYPE_CHECKING:`, which are for annotations and never run)."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stallfree"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stallfree"))
    return found


def test_no_import_cycles() -> None:
    """Each layer imports downwards only: a cycle, even through an import inside a function,
    means two modules share one job."""
    package = ROOT / "src" / "stallfree"
    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()
    }
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        for nxt in graph[name]:
            if nxt in stack:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for name in graph:
        visit(name, [name])
    assert not cycles, sorted(set(cycles))[:10]


# The functions still over the budget below, each with its reason; the list only shrinks.
_LONG_FUNCTIONS: set[str] = set()


def test_modules_stay_under_the_size_budget() -> None:
    """A module is read in one sitting (docs/DESIGN.md: files at most 400 lines): one over 400 has
    two jobs, and the seam between them is where it splits."""
    package = ROOT / "src" / "stallfree"
    sizes = {str(p.relative_to(package)): len(p.read_text().splitlines()) for p in package.rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > 400}


def test_functions_stay_under_the_size_budget() -> None:
    """A function is read in one screen (docs/DESIGN.md: functions at most 60 lines): a longer
    one does several steps that each want a name."""
    import ast

    package = ROOT / "src" / "stallfree"
    long = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    long[f"{path.relative_to(package)}:{node.name}"] = lines
    assert not {name: n for name, n in long.items() if name not in _LONG_FUNCTIONS}, long
    assert not _LONG_FUNCTIONS - set(long), "now under budget; drop from _LONG_FUNCTIONS"


def test_no_two_modules_share_a_name() -> None:
    """A module's file name says its job in the whole package: `build.py` in two folders makes
    a reader (and a traceback) ask which one."""
    package = ROOT / "src" / "stallfree"
    seen: dict[str, list[str]] = {}
    for path in package.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(package)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_issue_numbers_in_the_code() -> None:
    """Comments and docstrings say why; where a change came from belongs in its commit body
    (a reader of the code has no tracker)."""
    import re

    cites = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "src" / "stallfree").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if cites.search(line)
    ]
    assert not found, found


def test_subcommands_are_registered_by_the_cli_and_commands() -> None:
    """One place lists the commands: `cli.py` and `commands/` (a reader looking for a
    command's flags finds them there, not in the module that does its work)."""
    package = ROOT / "src" / "stallfree"
    allowed = {package / "cli.py", *(package / "commands").rglob("*.py")}
    found = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path not in allowed and "add_parser(" in path.read_text()
    ]
    assert not found, found


def test_module_docstrings_are_a_few_lines() -> None:
    """A module's docstring says what it does and the key why; the detail sits next to the code
    it explains, and measurements live in benchmarks/RESULTS.md."""
    import ast

    package = ROOT / "src" / "stallfree"
    long = {}
    for path in package.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is not None and len(doc.splitlines()) > 8:
            long[str(path.relative_to(package))] = len(doc.splitlines())
    assert not long, f"module docstrings over 8 lines: {long}"


# A checkpoint's top-level keys (train/checkpoint/format.py's FORMAT): only train/checkpoint/
# reads them; every other module goes through `SavedCheckpoint`'s typed properties.
_CHECKPOINT_KEYS = {
    "class_names",
    "counters",
    "data",
    "ema",
    "epoch",
    "format",
    "metrics_records",
    "model",
    "num_classes",
    "position",
    "ranks",
    "recipe",
    "resolved",
    "segments",
    "stallfree_version",
    "totals",
    "upgraded_from",
    "val_top1",
    "world_size",
}


def _checkpoint_reads(path: Path) -> list[int]:
    """Lines of `path` that take a checkpoint key from a loaded dict (`state["epoch"]`,
    `found.state.get("model")`, `"ema" in ckpt`), outside a part (a class with a
    `load_state_dict`), which reads its own state under its own key."""
    import ast

    tree = ast.parse(path.read_text())
    own = {
        id(n)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == "load_state_dict" for f in c.body)
        for n in ast.walk(c)
    }
    names = {"state", "ckpt", "checkpoint", "saved", "found", "loaded"}

    def is_dict(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr == "state"
        )

    def key(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in _CHECKPOINT_KEYS

    lines = []
    for node in ast.walk(tree):
        if id(node) in own:
            continue
        read = (
            (isinstance(node, ast.Subscript) and is_dict(node.value) and key(node.slice))
            or (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "pop", "setdefault")
                and is_dict(node.func.value)
                and bool(node.args)
                and key(node.args[0])
            )
            or (
                isinstance(node, ast.Compare)
                and key(node.left)
                and isinstance(node.ops[0], ast.In | ast.NotIn)
                and is_dict(node.comparators[0])
            )
        )
        if read:
            lines.append(node.lineno)
    return lines


def test_only_the_checkpoint_package_reads_a_checkpoints_keys() -> None:
    """One package knows a checkpoint's layout (train/checkpoint/): what others need of a saved
    one (epoch, position, world size, recipe, resolved record, weights) they read through
    `SavedCheckpoint`, so a new format changes one place."""
    package = ROOT / "src" / "stallfree"
    inside = package / "train" / "checkpoint"
    found = [
        f"{path.relative_to(package)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if inside not in path.parents
        for line in _checkpoint_reads(path)
    ]
    assert not found, found
