"""The models already on this machine, for the Model list: the hub models in the local Hugging Face cache and the
runs folder's merged exports, each with the task kind its config.json names."""

from __future__ import annotations

import json
from pathlib import Path

from finetune import registry as kinds
from finetune.use.export import EXPORT_DIR, MERGED_DIR


def config_kind(folder: Path) -> str | None:
    """The task kind a model folder's config.json names (by its architectures), or None without a readable one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return kinds.kind_of_model_config(config, default=None) if isinstance(config, dict) else None


def cached_models(cache_dir: str | Path | None = None) -> list[tuple[str, str | None]]:
    """Each model repository in the Hugging Face cache (`cache_dir`, default the hub's own) that has a config.json
    in a snapshot, as (hub id, kind), sorted by id; none without a cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        snapshots = [r.snapshot_path for r in repo.revisions if (r.snapshot_path / "config.json").is_file()]
        if snapshots:  # a tokenizer-only or a half-downloaded repository cannot be trained
            out.append((repo.repo_id, config_kind(snapshots[0])))
    return sorted(out)


def merged_exports(runs_dir: Path) -> list[tuple[Path, str | None]]:
    """Each run's merged export (`<run>/export/merged`, a plain transformers folder) under `runs_dir`, as (folder,
    kind), the newest first."""
    folders = [p for p in runs_dir.glob(f"*/{EXPORT_DIR}/{MERGED_DIR}") if (p / "config.json").is_file()]
    folders.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [(p, config_kind(p)) for p in folders]
