"""How the engine and the app are put together: the engine's modules import each other without a cycle, only the CLI
imports the training loop, imports of other engine modules sit at the top of a module (function-local only in the
CLI, to keep `finetune --help` fast), and the error classes import nothing; the app's modules import each other
without a cycle (function-local imports included), its tabs import one another only for type hints, it writes no
kind's name, and none of its classes has more than 20 methods, nor any function more than 80 lines."""

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


def _imports(path: Path, modules: dict[str, Path] = MODULES, packages: set[str] = PACKAGES
             ) -> list[tuple[str, bool, bool]]:
    """(module of `modules` imported, whether at module level, whether for type checkers only) for every import in a
    file, function-local ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # Module level: the file's own statements, and the imports only type checkers read (`if TYPE_CHECKING:`).
    type_only = [n for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
                 for n in node.body]
    top, hints = {id(node) for node in [*tree.body, *type_only]}, {id(node) for node in type_only}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from finetune.data import load` imports the module finetune.data.load; `from finetune.data.load import
            # x` imports finetune.data.load.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top, id(node) in hints) for name in names
                  if name in modules and name not in packages]
    return found


GRAPH = {name: {target for target, _, _ in _imports(path)} for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]] = GRAPH) -> list[str] | None:
    """One import cycle among the modules of `graph`, as a path that returns to its start, or None."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(graph):
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


# Besides the CLI, the backends' entry points: `--backend`'s choices and each backend's options are read when the
# parser is built (`finetune --help` stays fast), and a backend imports its work (the Hub client, the planner) only
# when it runs.
LAZY_ENTRY_POINTS = {"finetune.__main__", "finetune.cli", "finetune.remote.cli",
                     "finetune.remote.hf_backend", "finetune.remote.slurm",
                     "finetune.remote.slurm.run"}


def test_engine_modules_are_imported_at_the_top_outside_the_cli():
    lazy = [(name, target) for name, path in MODULES.items() if name not in LAZY_ENTRY_POINTS
            for target, at_top, _ in _imports(path) if not at_top]
    assert lazy == []


def test_the_errors_module_imports_nothing():
    tree = ast.parse((PACKAGE / "errors.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in imports] == ["from __future__ import annotations"]


# The task-kind layer (finetune.kinds) sits below the data, the engine, the planner, the models and the loop, which
# call it: it may import the errors, the registry, the one-build-at-a-time lock, the configuration, and the row
# helpers that import nothing but those (the floors below it: FLOORS).
KIND_LAYER_MAY_IMPORT = ("finetune.errors", "finetune.registry", "finetune.building", "finetune.config.",
                         "finetune.kinds.", "finetune.rows.arrow", "finetune.rows.chat", "finetune.rows.segments")


def test_the_task_kind_layer_imports_nothing_above_it():
    kinds = [name for name in GRAPH if name.startswith("finetune.kinds.")]
    assert {"finetune.kinds.base", "finetune.kinds.classification",
            "finetune.kinds.causal_lm"} <= set(kinds)
    above = sorted((name, target) for name in kinds for target in GRAPH[name]
                   if not target.startswith(KIND_LAYER_MAY_IMPORT))
    assert above == []
    # The data helpers it uses stay below it too.
    helpers = sorted((name, target) for name in ("finetune.rows.arrow", "finetune.rows.chat", "finetune.rows.segments")
                     for target in GRAPH[name]
                     if not target.startswith(("finetune.errors", "finetune.registry", "finetune.config.")))
    assert helpers == []


def test_the_kind_registry_imports_no_kind():
    """The registry imports the kinds' declarations (finetune/specs/, which import nothing of the package but each
    other), and no kind's implementation."""
    assert {target for target, _, _ in _imports(MODULES["finetune.registry"], packages=set())} == {"finetune.specs"}
    specs = {name: GRAPH[name] for name in GRAPH if name.startswith("finetune.specs")}
    assert set().union(*specs.values()) <= set(specs) and len(specs) > 12


def test_a_kind_is_its_declaration_and_its_implementation_and_no_other_file_of_the_package():
    """Each kind's declaration is finetune/specs/<kind>.py (tests/test_kinds.py: the declared kinds are `task`'s
    choices), and nothing else of the package names the kind's implementation module: adding a kind touches no file
    of the package but its two."""
    from finetune import registry

    for name in registry.names():
        module = registry.entry(name).module
        outside = sorted(other for other, targets in GRAPH.items() if not other.startswith(module)
                         and not other.startswith("finetune.kinds.") and module in targets)
        assert outside == [], f"{module} is imported by {outside}"


# --- the app
APP_MODULES = {_module(p): p for p in sorted((ROOT / "app").rglob("*.py"))}
APP_PACKAGES = {name for name, path in APP_MODULES.items() if path.stem == "__init__"}
APP_IMPORTS = {name: _imports(path, APP_MODULES, APP_PACKAGES) for name, path in APP_MODULES.items()}
APP_GRAPH = {name: {target for target, _, _ in found} for name, found in APP_IMPORTS.items()}
# What runs: an import only type checkers read (a tab naming `app.tabs.Handlers`, which lists the tabs) knots nothing.
APP_RUNTIME = {name: {target for target, _, type_only in found if not type_only} for name, found in APP_IMPORTS.items()}
TABS = ("app.train.", "app.tryit.", "app.runs.", "app.export.")  # one package per tab of the page
MAX_METHODS, MAX_LINES = 20, 80


def test_the_app_graph_sees_the_imports_it_should():
    assert "app.page" in APP_GRAPH["app.serve"]  # function-local
    assert "app.door.server" in APP_GRAPH["app.serve"] and "app.page" not in APP_GRAPH["app.door.server"]
    assert {"app.door.policy", "app.client", "app.local.training"} <= APP_GRAPH["app.state"]
    # A run elsewhere is followed through the local training manager (its status, its one-job lock); the job client,
    # the one place that starts either, sits above both packages.
    assert "app.local.training" in APP_GRAPH["app.remote.jobs"]
    assert {"app.local.training", "app.remote.jobs"} <= APP_GRAPH["app.client"]
    assert "app.tabs" in APP_GRAPH["app.export.tab"]  # for type checkers only
    assert {"app.tabs", "app.api"} <= APP_GRAPH["app.page"]  # the page composes the tabs that app.tabs lists
    assert {"app.train.tab", "app.tryit.tab", "app.runs.tab", "app.export.tab"} <= APP_GRAPH["app.tabs"]


def test_app_modules_import_each_other_without_a_cycle():
    # Function-local imports count too: the one circle the app had (page → api → export → page) hid in one.
    assert _cycle(APP_RUNTIME) is None, " → ".join(_cycle(APP_RUNTIME))


def _app_package(module: str) -> str:
    """The package (or root module) of the app that `module` belongs to: `app.door.policy` → door."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _app_package_graph(graph: dict[str, set[str]] = APP_RUNTIME) -> dict[str, set[str]]:
    packages = {_app_package(name) for name in graph}
    return {p: {_app_package(t) for name in graph if _app_package(name) == p for t in graph[name]} - {p}
            for p in packages}


def test_the_app_packages_import_each_other_without_a_cycle():
    """Runtime imports (function-local ones too) between the app's packages and root modules make no cycle: the door
    is served the page by `app.serve`, above it, and the job client (`app.client`) sits above `local` and `remote`."""
    graph = _app_package_graph()
    assert {"door", "local", "remote", "client", "train", "tryit", "runs", "export", "follow", "tabs", "page",
            "serve"} <= set(graph)
    assert "page" in graph["serve"] and "remote" in graph["client"]  # the graph sees the imports that would tie one
    assert _cycle(graph) is None, " → ".join(_cycle(graph))


def _reached(start: str, graph: dict[str, set[str]] = APP_RUNTIME) -> set[str]:
    """The modules `start` imports at run time, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_poll_imports_no_tab():
    """The poll (`app.follow`) hands what it saw to each tab's own `refresh`, listed in `app.tabs.REFRESHES`: it
    imports no tab, nor the list of them, directly or through another module."""
    reached = _reached("app.follow")
    assert {"app.state", "app.local.training"} <= reached  # the walk sees what the poll imports
    assert sorted(name for name in reached if name.startswith(TABS) or name in ("app.tabs", "app.page")) == []
    assert {"app.train.tab", "app.tryit.tab", "app.export.tab"} <= _reached("app.tabs")


def test_the_tabs_import_one_another_only_for_type_hints():
    """Each tab builds its own widgets and wires its own events; what they share is in app/ itself (the request
    policy, the job client, the state, the results), and the page wires the events that cross tabs."""
    def tab(name: str) -> str | None:
        return next((t for t in TABS if name.startswith(t)), None)

    crossing = sorted((name, target) for name, found in APP_IMPORTS.items() for target, _, type_only in found
                      if tab(name) and tab(target) and tab(name) != tab(target) and not type_only)
    assert crossing == []
    assert {tab(name) for name in APP_MODULES} >= {*TABS, None}


def _defs(kind: type) -> list[tuple[str, ast.AST]]:
    return [(f"{name}.{node.name}", node) for name, path in APP_MODULES.items()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, kind)]


def test_no_class_of_the_app_has_more_than_20_methods():
    methods = {name: sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
               for name, node in _defs(ast.ClassDef)}
    assert len(methods) > 20 and "app.local.training.JobManager" in methods
    assert {name: n for name, n in methods.items() if n > MAX_METHODS} == {}


MAX_KIND_METHODS = 25  # a kind is composed of its roles (data codec, objective, window loss, plan terms, …)


def test_no_class_of_the_kinds_has_more_than_25_methods():
    """A kind too big to read splits along the role protocols of finetune/kinds/base.py (GRPO: its codec,
    generation, loss, metrics and plan terms, each a class of its own), each class with its own members."""
    methods = {f"{path.relative_to(PACKAGE / 'kinds')}:{node.name}":
               sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
               for path in sorted((PACKAGE / "kinds").rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)}
    assert methods["grpo/__init__.py:GRPO"] > 5 and methods["preference.py:PairCodec"] > 5
    assert {name: n for name, n in methods.items() if n > MAX_KIND_METHODS} == {}


def test_no_function_of_the_app_is_longer_than_80_lines():
    lengths = {name: node.end_lineno - node.lineno + 1
               for kind in (ast.FunctionDef, ast.AsyncFunctionDef) for name, node in _defs(kind)}
    assert lengths["app.page.build"] > 20
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_app_writes_no_kinds_name():
    """A kind's views, previews, plots and presets are chosen through its registry entry (`Entry.try_view`, …), so
    adding a kind touches no app module; a string that is a kind's name would be a comparison waiting to happen."""
    from finetune import registry

    named = sorted((name, node.value) for name, path in APP_MODULES.items()
                   for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(node, ast.Constant) and node.value in registry.names())
    assert named == []


# The kind names the engine may still write outside finetune/kinds/, each with the reason its line's comment gives.
KIND_NAMES_ALLOWED = {
    # A chat loads its model as a causal LM whatever the folder's architectures say (`finetune.use.predict.chat`).
    ("finetune.use.predict", "causal_lm"): 1,
    # `finetune doctor`'s self-test trains one window of a tiny Llama, the shape most runs have.
    ("finetune.doctor.selftest", "causal_lm"): 1,
}


def test_the_engine_writes_no_kinds_name_outside_the_kinds():
    """Outside `finetune/kinds/` a kind is asked through its registry entry (`Entry.generates`, `features`, …) or
    its protocol (`card_rows`, …), not compared by name; the few names left are listed above, with why."""
    from finetune import registry

    counts: dict[tuple[str, str], int] = {}
    for name, path in MODULES.items():
        # Where the kinds are named: their implementations, their declarations, the registry.
        if name.startswith(("finetune.kinds.", "finetune.specs")) or name == "finetune.registry":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in registry.names():
                counts[name, node.value] = counts.get((name, node.value), 0) + 1
    assert counts == KIND_NAMES_ALLOWED


# --- the task-kind contract: every hook the engine calls on a kind is declared (finetune.kinds.base.TaskKind)
def _kind_members() -> set[str]:
    """The names of the kind contract's members and of every kind's own (fields of a configured kind included)."""
    from finetune import registry
    from finetune.kinds.base import TaskKind

    return {name for cls in (TaskKind, *(type(registry.kind(n)) for n in registry.names()))
            for klass in cls.__mro__ for name in vars(klass) if not name.startswith("__")}


# Names of the contract that other objects have too (a `datasets` table's features, a model's config and
# tokenizer, a dataclass's fields): asked of those, they are no probe of a kind.
NOT_ONLY_HOOKS = {"features", "metrics", "entry", "tokenizer", "model", "seed", "loss", "lora", "weights", "score",
                  "temperature", "stats", "inputs", "rewards", "trust_remote_code", "beta", "reference_model"}


def _kind_probes(roots: tuple[Path, ...] = (PACKAGE, ROOT / "app")) -> list[str]:
    """`hasattr(x, "name")` and `getattr(x, "name", …)` outside `finetune/kinds/` where `x` is a kind (its source
    names one: `kind`, `s.kind`, `kind_named(…)`, `configured(c)`) or any object but a table's or a model's and
    `name` a hook of the contract: a hook asked for by name instead of called."""
    hooks = _kind_members() - NOT_ONLY_HOOKS
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(PACKAGE / "kinds"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id in ("hasattr", "getattr") and len(node.args) >= 2 and \
                        isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    target = ast.unparse(node.args[0])
                    if "kind" in target or "configured(" in target or node.args[1].value in hooks:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_calls_a_kinds_hooks_and_never_probes_for_them():
    """Every hook is a member of `TaskKind` with a default a kind inherits, so the engine calls it: a probe would
    hide a hook the contract does not declare."""
    assert _kind_probes() == []


# --- packages as floors: each of finetune's packages imports only those below it (function-local and type-only
# imports included), so the package graph has no cycle, not only the file graph.
FLOORS = (
    ("errors", "specs"),  # the error classes; what each task kind declares (torch-free)
    ("registry", "building"),  # the task kinds by name (importing no kind's implementation); one model built at a
    # time in a process
    ("config",),  # the typed config, its checks and the batch arithmetic
    ("rows",),  # Arrow columns, chat templates, document segments: what the kinds read rows with
    ("kinds",),  # the task kinds' implementations (finetune.kinds.base.TaskKind)
    ("data",),  # loading, encoding and caching a data set, through the kinds
    ("engine",),  # the runtime, the loss, the step, the metrics: the loop's parts
    ("models",),  # loading a model for a kind: quantized, with LoRA, offloaded
    ("plan",),  # the memory planner
    ("run",),  # the run directory: events, checkpoints, trackers, the model card, storage
    ("use",),  # after training: predict, evaluate, export, publish to the Hub
    ("train",),  # the training loop
    ("sweep",),  # hyper-parameter sweeps: trials trained by the loop the CLI hands in
    ("remote",),  # Hugging Face Jobs: a run elsewhere
    ("doctor",),  # versions, the machine, the self-test
    ("cli", "__init__"),  # the command line; the package's version
    ("__main__",),  # python -m finetune
)
FLOOR = {package: level for level, names in enumerate(FLOORS) for package in names}


def _package(module: str) -> str:
    """The package (or top-level module) of finetune that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_graph() -> dict[str, set[str]]:
    return {package: {_package(t) for name in MODULES if _package(name) == package for t in GRAPH[name]} - {package}
            for package in {_package(name) for name in MODULES}}


def test_every_package_has_a_floor():
    assert set(_package_graph()) == set(FLOOR)


def test_each_package_imports_only_the_floors_below_it():
    up = sorted((f"finetune.{a}", f"finetune.{b}") for a, targets in _package_graph().items() for b in targets
                if FLOOR[b] >= FLOOR[a])
    assert up == []


def test_the_packages_import_each_other_without_a_cycle():
    graph = _package_graph()
    assert _cycle(graph) is None, " → ".join(_cycle(graph))


def test_a_package_cycle_is_found_where_no_file_cycle_is():
    """The check above sees a knot of packages that no two files make: a → b in one pair of files, b → a in
    another."""
    files = {"p.a1": {"q.b1"}, "q.b2": {"p.a2"}, "p.a2": set(), "q.b1": set()}
    assert _cycle(files) is None
    packages = {"p": {"q"}, "q": {"p"}}
    assert _cycle(packages) == ["p", "q", "p"]


# --- the planner, split by the question each part answers (listed in finetune/plan/planner.py's docstring)
PLANNER = "finetune.plan."
PLANNER_MODULE_LINES = 400


def test_no_module_of_the_planner_is_longer_than_400_lines():
    lines = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()
             if name.startswith(PLANNER)}
    assert "finetune.plan.planner" in lines  # the planner's modules are found
    assert {name: n for name, n in lines.items() if n > PLANNER_MODULE_LINES} == {}


def test_the_planner_imports_no_kind_only_the_kinds_protocols():
    """A kind's own rung (causal LM's chunked loss) reaches the planner through its protocol (`chunked_variant`):
    the planner imports finetune.kinds.base, never a kind."""
    assert "finetune.kinds.base" in GRAPH["finetune.plan.memory"]  # the graph sees the planner's imports
    kinds = sorted(f"{name} imports {target}" for name in MODULES if name.startswith(PLANNER) for target in GRAPH[name]
                   if target.startswith("finetune.kinds.") and target != "finetune.kinds.base")
    assert kinds == []


MAX_PACKAGE_LINES = 100  # a function of finetune/ (the loop's `train()` is the longest, 80)


def test_no_function_of_the_package_is_longer_than_100_lines():
    """A function that grows past a screenful splits by what its parts do (the CLI's parser: one function per
    command)."""
    lengths = {f"{name}.{node.name}": node.end_lineno - node.lineno + 1 for name, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert lengths["finetune.train.loop.train"] > 40 and lengths["finetune.cli.build_parser"] > 10
    assert {name: n for name, n in lengths.items() if n > MAX_PACKAGE_LINES} == {}
