"""The documentation stays true: every relative link in README.md and docs/*.md reaches a file (and a heading),
every repository path they name as code exists, every config and `finetune` command they show is one finetune
takes, the README's code map names every package of the engine, nothing names a folder outside the repository, and
the benchmarks that train on SST-2 take it from the hub or a `--data` folder."""

from __future__ import annotations

import argparse
import ast
import csv
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from finetune.config.schema import load
from finetune.errors import ConfigError

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (links there are examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2 suffixes for repeated headings."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    anchors, counts = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text)), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not checked (no network)


def test_the_anchor_rule_is_githubs():
    assert _slug("Long documents (`long_documents`)") == "long-documents-long_documents"
    assert _slug("Memory budget → training plan") == "memory-budget--training-plan"
    assert _slug("Packing (`packing: true`)") == "packing-packing-true"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
        elif not file.resolve().is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_docs_pages_are_linked_from_the_docs_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "docs" / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in linked]
    assert index and not unlinked, f"docs/README.md does not link {unlinked}"


def test_the_readme_code_map_names_every_package_of_the_engine():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code_map = readme.split("## Start reading the code here", 1)[1]
    packages = sorted(p.parent.name for p in (ROOT / "finetune").glob("*/__init__.py"))
    missing = [name for name in packages if f"{name}/" not in code_map and f"{name}," not in code_map]
    assert not missing, f"README's 'Start reading the code here' does not name finetune/{missing}"


# What a reader opens next: a repository path written as code (`app/local/sweeps.py`, `finetune/plan/`), a module or
# one of its names written as code (`app.door.server.launch`), and in the code's own docstrings and comments also a
# module's file written plainly (app/train/tasks.py). An upper-case NAME stands for a file the reader would write
# (docs/jobs.md's new backend).
CODE_PATH = re.compile(r"`((?:app|finetune|tests|bench|docs|assets|\.ci)/[\w./-]*)`")
CODE_NAME = re.compile(r"`((?:app|finetune)(?:\.[A-Za-z_]\w*)+)")
MODULE_FILE = re.compile(r"(?<![\w./-])((?:app|finetune|tests|bench)/[\w/]+\.py)\b")


@functools.cache
def _top_names(source: Path) -> set[str]:
    """The names a module defines at its top: functions, classes, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _defined(dotted: str) -> bool:
    """The longest prefix of `dotted` that is a module of the repository, and the next name defined at its top."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if source is not None:
            return i == len(parts) or parts[i] in _top_names(source)
    return False


def _stale(text: str, plain: bool = False) -> list[str]:
    """The paths and module names `text` writes as code (with `plain`, module files written plainly too) that the
    repository does not have."""
    paths = set(CODE_PATH.findall(text)) | (set(MODULE_FILE.findall(text)) if plain else set())
    missing = {p for p in paths if "NAME" not in p and not (ROOT / p).exists()}
    return sorted(missing | {name for name in CODE_NAME.findall(text) if not _defined(name)})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_module_the_docs_name_as_code_exists(page):
    """A module moved or renamed leaves no stale name in the prose: `app/jobs/sweeps.py` outlived its folder, and
    `finetune.train.train` the move of `train()` into `finetune/train/loop.py`."""
    stale = _stale(FENCE.sub("", page.read_text(encoding="utf-8")))
    assert not stale, f"{page.name} names paths or modules the repository does not have: {stale}"


def _fenced(text: str) -> list[tuple[str, str, int]]:
    """Each fenced code block of a page: its info string (`yaml`, `bash`), its body and the line it starts on."""
    blocks = []
    for m in FENCE.finditer(text):
        info, _, body = m.group(0).partition("\n")
        blocks.append((info[3:].strip(), body.rpartition("\n")[0], text[:m.start()].count("\n") + 1))
    return blocks


def _yaml_blocks() -> list[tuple[str, str]]:
    """Every fenced YAML block of the README and docs/, with the page and line it starts on."""
    return [(f"{page.name}:{line}", body) for page in PAGES
            for info, body, line in _fenced(page.read_text(encoding="utf-8")) if info in ("yaml", "yml")]


def test_every_yaml_example_of_the_docs_is_a_config_finetune_takes(tmp_path):
    """A config or sweep file a page shows loads as finetune loads it (options renamed or removed fail here); the
    evaluation harness's own task files (docs/evaluations.md) are the harness's format, not ours."""
    from finetune.sweep.space import load_sweep

    checked = 0
    for where, block in _yaml_blocks():
        if "doc_to_text:" in block:  # an lm-eval task file
            continue
        path = tmp_path / "example.yaml"
        path.write_text(block, encoding="utf-8")
        try:
            load_sweep(path) if "\nsweep:" in f"\n{block}" else load(path)
        except ConfigError as e:
            pytest.fail(f"{where}: {e}")
        checked += 1
    assert checked >= 3


def test_every_path_and_module_the_code_names_exists():
    """The same in the code's docstrings and comments: app/tasksview.py outlived its module."""
    stale = {f"{p.relative_to(ROOT)}: {', '.join(names)}" for p in _text_files()
             if p.suffix == ".py" and p != Path(__file__).resolve()
             and (names := _stale(p.read_text(encoding="utf-8", errors="replace"), plain=True))}
    assert not stale, f"paths or modules the repository does not have: {sorted(stale)}"


def test_a_stale_path_or_module_is_caught():
    """The patterns see what is written as code and skip the placeholders of a file the reader would write."""
    text = ("see `app/jobs/sweeps.py`, `finetune/remote/NAME/__init__.py`, `finetune.train.train` and "
            "`app.serve.main`; a comment's app/tasksview.py, and not the cache's ~/.cache/finetune/timing.py")
    assert CODE_PATH.findall(text) == ["app/jobs/sweeps.py", "finetune/remote/NAME/__init__.py"]
    assert CODE_NAME.findall(text) == ["finetune.train.train", "app.serve.main"]
    assert _stale(text) == ["app/jobs/sweeps.py", "finetune.train.train"]
    assert _stale(text, plain=True) == ["app/jobs/sweeps.py", "app/tasksview.py", "finetune.train.train"]
    assert not _defined("app.jobs.sweeps") and not _defined("finetune.train.nothing")
    assert _defined("finetune.train.loop.train") and _defined("app.serve.main") and _defined("app.door")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


# `finetune`, its subcommand and a nested one (not a file or a key=value after it), then the rest of the command.
SHOWN_COMMAND = re.compile(r"(?:^|[\s$])finetune((?: [a-z][a-z-]*(?![\w./=])){1,2})([^\n|;&#]*)")


def _shown_commands(text: str) -> list[tuple[list[str], list[str]]]:
    """Each `finetune …` command a page shows as code (fenced blocks and inline code): its words, then its flags."""
    code = [body for _, body, _ in _fenced(text)] + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return [(m.group(1).split(), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)))
            for block in code for m in SHOWN_COMMAND.finditer(block)]


def test_every_finetune_command_the_docs_show_is_one_the_cli_takes():
    """A subcommand or a flag renamed in the CLI leaves no command in the README or docs/ that would be refused."""
    from finetune.cli import build_parser

    commands = _subcommands(build_parser())
    wrong, shown = [], 0
    for page in PAGES:
        for words, flags in _shown_commands(page.read_text(encoding="utf-8")):
            shown += 1
            parser = commands.get(words[0])
            if parser is None:
                wrong.append(f"{page.name}: finetune {words[0]}")
                continue
            nested = _subcommands(parser)
            if nested and len(words) > 1:
                if words[1] not in nested:
                    wrong.append(f"{page.name}: finetune {' '.join(words)}")
                    continue
                parser = nested[words[1]]
            known = {option for action in parser._actions for option in action.option_strings}
            wrong += [f"{page.name}: finetune {' '.join(words)} {flag}" for flag in flags if flag not in known]
    assert shown > 30 and not wrong, (shown, wrong)
    # The reading sees a subcommand, a nested one and flags, and only in code.
    assert _shown_commands("run `finetune jobs follow RUN --json` or\n```\nfinetune train a.yaml --dry-run\n```\n"
                           "finetune says no") == [(["train"], ["--dry-run"]), (["jobs", "follow"], ["--json"])]


def _text_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = tracked.stdout.split() if tracked.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts]
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".jinja", ""}
    return [ROOT / n for n in names if (ROOT / n).is_file() and Path(n).suffix in suffixes]


def test_nothing_names_a_folder_outside_the_repository():
    folder = "shared"  # the development machines' read-only folder beside the repository, which users do not have
    pattern = re.compile(rf"\.\./{folder}\b|{folder}/data|\"{folder}\" */")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _text_files() if p != Path(__file__).resolve()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line)]
    assert not hits, f"a path outside the repository (users do not have it): {hits}"


BENCH = ROOT / "bench"


@pytest.mark.parametrize("script", ["trainer_vs_finetune.py", "data_prep.py", "multitask_sst2.py",
                                    "preference_vs_trl.py"])
def test_the_sst2_benchmarks_take_the_hub_or_a_data_folder(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--data FOLDER" in proc.stdout and "glue/sst2" in proc.stdout


def test_the_hub_sst2_is_exported_as_the_tsv_files_a_data_folder_holds(tmp_path, monkeypatch):
    import datasets

    monkeypatch.syspath_prepend(str(BENCH))
    import sst2_data

    rows = {"train": {"sentence": ['a "quoted" tab\tin it ', "plain "], "label": [1, 0], "idx": [0, 1]},
            "validation": {"sentence": ["fine "], "label": [1], "idx": [0]}}
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a: asked.append(a) or datasets.DatasetDict(
        {k: datasets.Dataset.from_dict(v) for k, v in rows.items()}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = sst2_data.sst2_folder(None)
    assert asked == [("glue", "sst2")] and folder == tmp_path / "finetune" / "bench" / "sst2"
    for split, expected in rows.items():
        with open(folder / f"{split}.tsv", newline="", encoding="utf-8") as f:
            got = list(csv.DictReader(f, delimiter="\t"))
        want = list(zip(expected["sentence"], expected["label"], strict=True))
        assert [(r["sentence"], int(r["label"])) for r in got] == want
    assert sst2_data.sst2_folder(None) == folder and len(asked) == 1  # exported once
    assert sst2_data.sst2_folder(folder) == folder  # a --data folder with both files
    with pytest.raises(SystemExit, match="has no train.tsv or validation.tsv: pass --data"):
        sst2_data.sst2_folder(tmp_path)
