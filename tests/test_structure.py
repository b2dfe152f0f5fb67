"""How the engine is put together: its modules import each other without a cycle, only the CLI imports the training
loop, imports of other engine modules sit at the top of a module (function-local only in the CLI, to keep
`finetune --help` fast), and the error classes import nothing."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "finetune"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.stem == "__init__"}
LOOP = "finetune.train"  # the training loop's package: only the CLI imports it


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(engine module imported, whether at module level) for every import in a file, function-local ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # Module level: the file's own statements, and the imports only type checkers read (`if TYPE_CHECKING:`).
    type_only = [n for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
                 for n in node.body]
    top = {id(node) for node in [*tree.body, *type_only]}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from finetune.data import load` imports the module finetune.data.load; `from finetune.data.load import
            # x` imports finetune.data.load.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top) for name in names if name in MODULES and name not in PACKAGES]
    return found


GRAPH = {name: {target for target, _ in _imports(path)} for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import cycle among the engine's modules, as a path that returns to its start, or None."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_the_graph_sees_the_imports_it_should():
    assert "finetune.train.loop" in GRAPH["finetune.cli"]  # function-local
    assert {"finetune.train.variants", "finetune.data.load", "finetune.engine.step"} <= GRAPH["finetune.train.loop"]
    assert "finetune.plan.planner" in GRAPH["finetune.train.variants"]
    assert "finetune.engine.losses" in GRAPH["finetune.engine.step"]


def test_engine_modules_import_each_other_without_a_cycle():
    assert _cycle() is None, " → ".join(_cycle())


def test_only_the_cli_imports_the_training_loop():
    importers = sorted(name for name, targets in GRAPH.items() if "finetune.train.loop" in targets)
    assert importers == ["finetune.cli"]


def test_engine_modules_are_imported_at_the_top_outside_the_cli():
    lazy = [(name, target) for name, path in MODULES.items() if name != "finetune.cli"
            for target, at_top in _imports(path) if not at_top]
    assert lazy == []


def test_the_errors_module_imports_nothing():
    tree = ast.parse((PACKAGE / "errors.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in imports] == ["from __future__ import annotations"]


# The task-kind layer (finetune.kinds) sits below the data, the engine, the planner, the models and the loop, which
# call it: it may import the configuration, the errors, and the data helpers that import nothing but those.
KIND_LAYER_MAY_IMPORT = ("finetune.errors", "finetune.config.", "finetune.kinds.", "finetune.data.arrow",
                         "finetune.data.chat", "finetune.data.segments")


def test_the_task_kind_layer_imports_nothing_above_it():
    kinds = [name for name in GRAPH if name.startswith("finetune.kinds.")]
    assert {"finetune.kinds.base", "finetune.kinds.registry", "finetune.kinds.classification",
            "finetune.kinds.causal_lm"} <= set(kinds)
    above = sorted((name, target) for name in kinds for target in GRAPH[name]
                   if not target.startswith(KIND_LAYER_MAY_IMPORT))
    assert above == []
    # The data helpers it uses stay below it too.
    helpers = sorted((name, target) for name in ("finetune.data.arrow", "finetune.data.chat", "finetune.data.segments")
                     for target in GRAPH[name] if not target.startswith(("finetune.errors", "finetune.config.")))
    assert helpers == []


def test_the_kind_registry_imports_no_kind():
    assert GRAPH["finetune.kinds.registry"] == set()
