"""What the page hands out to download: a run's model as a zip, its log, an export's files.

Gradio copies a file a handler returns into its cache (under a path nobody can guess) only from the working or the
temporary directory, and nothing under the runs folder is served by URL; so a file from elsewhere is handed out from
a temporary folder of this app's, one folder per run folder (two users' runs of the same name never share a file),
under the name the browser saves it as.

That folder is in Gradio's own (GRADIO_TEMP_DIR, which the server puts beside the runs: one disk, so a hand-out is a
link, not a copy): the server's sweep deletes what is a day old there (`cleanup.tidy`), the folder of an app killed
before it could tidy up included, and an app that exits deletes its own. A hard link keeps a deleted run's bytes on
the disk, so it must not outlive the hand-out by long.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path

from app.door.cleanup import DOWNLOADS_PREFIX, gradio_temp_dir


class Downloads:
    """The app's folder of handed-out files (made on first use)."""

    def __init__(self) -> None:
        self._folder: Path | None = None

    def _root(self) -> Path:
        if self._folder is None:
            parent = gradio_temp_dir() or Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix=DOWNLOADS_PREFIX, dir=parent))
            atexit.register(shutil.rmtree, self._folder, ignore_errors=True)
        else:
            self._folder.mkdir(exist_ok=True)  # the sweep deletes it once its files are a day old and it is empty
        return self._folder

    def _named(self, key: str, name: str) -> Path:
        """Where a file is handed out as `name`, in a folder of its own for `key` (a source folder, a content)."""
        folder = self._root() / hashlib.sha256(key.encode()).hexdigest()[:16]
        folder.mkdir(exist_ok=True)
        return folder / name

    def handout(self, path: Path, name: str | None = None) -> str:
        """A path the download button may take, named `name` (default: the file's own name, after its folder's when
        it is handed out from elsewhere)."""
        resolved = path.resolve()
        if name in (None, path.name) and any(resolved.is_relative_to(Path(d).resolve())
                                             for d in (Path.cwd(), tempfile.gettempdir())):
            return str(path)
        out = self._named(str(resolved.parent), name) if name else self._root() / f"{path.parent.name}-{path.name}"
        if not out.is_file() or out.stat().st_mtime < path.stat().st_mtime:
            out.unlink(missing_ok=True)
            try:
                os.link(path, out)  # free on the same file system
            except OSError:
                shutil.copyfile(path, out)
        return str(out)

    def content(self, name: str, text: str) -> str:
        """`text` as a file named `name`, in a folder named by its content (two pages that export at once never
        share a file, and exporting the same text again writes nothing new)."""
        out = self._named(text, name)
        if not out.is_file():
            out.write_text(text, encoding="utf-8")
        return str(out)

    def text(self, run_dir: Path, name: str, text: str) -> str:
        """`text` as a file named `name` of run folder `run_dir` (a run's whole log, written afresh each time)."""
        out = self._named(str(run_dir.resolve()), name)
        out.write_text(text, encoding="utf-8")
        return str(out)


_ZIP_LOCK = threading.Lock()  # two tabs (or a tab and a script) asking for the same zip build it once


def zip_model(model_dir: Path, out: Path) -> Path:
    """A zip of the model folder (weights stored, other files deflated) at `out`, rebuilt only when the folder is
    newer; built once under a lock, into a unique temporary name that is renamed into place when complete."""
    with _ZIP_LOCK:
        files = sorted(path for path in model_dir.rglob("*") if path.is_file())
        newest = max((path.stat().st_mtime for path in files), default=0.0)
        if out.is_file() and out.stat().st_mtime >= newest:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        try:
            with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w") as archive:
                for path in files:
                    # Weights hardly compress and are most of the bytes: store them, deflate the small text files.
                    kind = zipfile.ZIP_STORED if path.suffix in (".safetensors", ".bin") else zipfile.ZIP_DEFLATED
                    archive.write(path, f"{model_dir.parent.name}-{model_dir.name}/{path.relative_to(model_dir)}",
                                  compress_type=kind)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return out
