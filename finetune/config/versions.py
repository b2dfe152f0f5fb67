"""The supported range of every dependency, read from what this project declares, against what is installed.

The ranges are pyproject.toml's (the floors are tested by `.ci/floors`): a source checkout reads its own
pyproject.toml, an installed package its metadata. `finetune` checks the core packages before any command imports
them, so a too-old transformers in an existing environment (a CUDA image, Colab, a cluster module) is one sentence
with the package, the version found and the version needed, not an AttributeError deep in a run.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from finetune.errors import PackageError

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# The extras whose packages `finetune doctor` does not report: the test suite's, the benchmarks', and an alias.
UNREPORTED_EXTRAS = ("test", "bench", "gpu")


@dataclass(frozen=True)
class Package:
    """One declared dependency: its name, the range declared, the version installed (None: not installed), and
    the extra it belongs to (None: a core dependency)."""

    name: str
    wanted: str
    found: str | None
    extra: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the installed version is in the declared range (an extra that is not installed is fine)."""
        if self.found is None:
            return self.extra is not None
        try:
            return Requirement(f"{self.name}{self.wanted}").specifier.contains(Version(self.found), prereleases=True)
        except (InvalidRequirement, InvalidVersion):
            return True  # a local build with a version packaging cannot read: nothing to say about it

    def problem(self) -> str | None:
        """One sentence on what is wrong and what to do, or None."""
        if self.ok:
            return None
        if self.found is None:
            return f"{self.name} is not installed; finetune needs {self.name}{self.wanted}: pip install " \
                   f"'{self.name}{self.wanted}'."
        return (f"{self.name} {self.found} is installed, but finetune needs {self.name}{self.wanted}: pip install "
                f"'{self.name}{self.wanted}' (or install finetune into an environment that has it).")


def declared(pyproject: Path | None = None) -> list[tuple[Requirement, str | None]]:
    """Every declared requirement with its extra (None for core ones): from the checkout's pyproject.toml when this
    package runs from one, else from the installed metadata."""
    pyproject = pyproject or PYPROJECT
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "finetune":
            found = [(Requirement(r), None) for r in project.get("dependencies", [])]
            for extra, reqs in project.get("optional-dependencies", {}).items():
                found += [(Requirement(r), extra) for r in reqs if not r.startswith("finetune[")]
            return found
    found = []
    for text in metadata.requires("finetune") or []:
        req = Requirement(text)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", str(req.marker)) if req.marker else None
        req.marker = None
        if not req.name == "finetune":
            found.append((req, extra[1] if extra else None))
    return found


def installed(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def packages(extras: tuple[str, ...] | None = None, pyproject: Path | None = None) -> list[Package]:
    """The core dependencies and those of `extras` (default: every extra a user installs, each needed only by the
    options it names), each with its range and installed version (one row a name)."""
    rows: dict[str, Package] = {}
    for req, extra in declared(pyproject):
        if extra is not None and (extra in UNREPORTED_EXTRAS if extras is None else extra not in extras):
            continue
        if req.name not in rows or rows[req.name].extra is not None and extra is None:
            rows[req.name] = Package(req.name, str(req.specifier), installed(req.name), extra)
    return list(rows.values())


def problems(extras: tuple[str, ...] = ()) -> list[str]:
    """One sentence per core package (and package of `extras`) outside its declared range."""
    return [p for package in packages(extras) if (p := package.problem())]


def require(extras: tuple[str, ...] = ()) -> None:
    """Raise `PackageError` (exit 2) naming the first package outside its range, before anything imports it."""
    found = problems(extras)
    if found:
        raise PackageError(found[0] if len(found) == 1 else
                           f"{found[0]} ({len(found) - 1} more: `finetune doctor` lists them all.)")
