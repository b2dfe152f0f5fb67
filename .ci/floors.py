"""Print the floor of every dependency that pyproject.toml declares with `>=`, as `name==version` constraints.

The floors lane (`.ci/floors`) installs exactly these, so that a floor written in pyproject.toml is a tested promise
(torch, installed first by the user for their CUDA, is left as it is: see the lane's comment)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SKIP = {"torch"}


def floors(pyproject: Path, extras: tuple[str, ...] = ()) -> list[str]:
    """`name==floor` for the declared dependencies (and those of `extras`) that have a `>=` floor."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    declared = list(project["dependencies"])
    for extra in extras:
        declared += project["optional-dependencies"][extra]
    pins = []
    for requirement in declared:
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
        if match and match[1].lower() not in SKIP:
            pins.append(f"{match[1]}=={match[3]}")  # a constraint names no extras
    return pins


if __name__ == "__main__":
    print("\n".join(floors(Path(__file__).resolve().parents[1] / "pyproject.toml", tuple(sys.argv[1:]))))
