"""What a GPU benchmark checks before it imports torch: every package it needs, in the range this project supports,
said in one line (not a traceback) on a stock image whose packages may be older, newer or missing.

    from preflight import check_packages
    check_packages("gpu_check.py", extras=("quantization",))
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_packages(script: str, extras: tuple[str, ...] = ()) -> None:
    """Exit 2 with one line naming each package that is missing or outside its range (the core ones and those of
    `extras`); return when all are there."""
    sys.path.insert(0, str(ROOT))
    try:
        from finetune.config.versions import problems  # reads package metadata only: no torch, no transformers
    except ImportError as e:  # not even `packaging` (a transformers dependency): the environment has nothing
        print(f"{script} cannot run here: {e.name or e} is not installed. See docs/benchmarks.md, \"Running on a "
              "GPU machine without network\".", file=sys.stderr)
        sys.exit(2)
    found = problems(extras)
    if found:
        print(f"{script} cannot run here: " + " ".join(found) + " See docs/benchmarks.md, \"Running on a GPU "
              "machine without network\".", file=sys.stderr)
        sys.exit(2)
