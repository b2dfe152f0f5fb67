"""The documentation stays true: every relative link in README.md and docs/*.md reaches a file (and a heading),
every repository path they name as code exists, the README's code map names every package of the engine, nothing
names a folder outside the repository, and the benchmarks that train on SST-2 take it from the hub or a `--data`
folder."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

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


# A repository path written as code in prose (`app/local/sweeps.py`, `finetune/plan/`): what a reader opens next.
# An upper-case NAME or a <placeholder> stands for a file the reader would write (docs/jobs.md's new backend).
CODE_PATH = re.compile(r"`((?:app|finetune|tests|bench|docs|assets|\.ci)/[\w./-]*)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_the_docs_name_as_code_exists(page):
    """A module moved or renamed leaves no stale path in the prose: `app/jobs/sweeps.py` outlived its folder."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    stale = sorted({p for p in CODE_PATH.findall(text)
                    if "NAME" not in p and not (ROOT / p.split("::")[0].rstrip("/")).exists()})
    assert not stale, f"{page.name} names paths the repository does not have: {stale}"


def test_a_stale_code_path_is_caught():
    """The pattern sees a path in backticks and skips the placeholders of a file the reader would write."""
    found = CODE_PATH.findall("see `app/jobs/sweeps.py` and `finetune/remote/NAME/__init__.py`, not <app/x.py>")
    assert found == ["app/jobs/sweeps.py", "finetune/remote/NAME/__init__.py"]
    assert not (ROOT / found[0]).exists()


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
