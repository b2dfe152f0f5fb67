"""Where a run folder lives, and whether what is written there outlives the machine.

A Space or a Job sees a Hugging Face storage bucket as a mounted folder (a volume); a restart keeps it, while the
container's own files (an overlay layer) and memory (tmpfs) are gone. `storage_of` reads the kernel's mount table
(`/proc/self/mountinfo`) to say which of these holds a path; a mount the caller knows to be a bucket (from the
Space's or the job's volumes) is named by `bucket_mounts`, since its file-system type alone does not say so.

The run folder's writes are safe on any of them (`finetune.run.rundir`): files are written beside their final name
and renamed over it, checkpoints are written under `step-N.partial` and renamed when complete; where a mount does
not rename (some object-store mounts copy instead, or refuse to rename a folder), the writer falls back to a copy
that is marked incomplete until its last file is in, and a checkpoint so marked is never resumed from.
`renames_atomically` probes a folder for the renames the run folder relies on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
# The errors a mount answers a rename it cannot do with (a folder on an object store, across devices, read-only
# metadata): the writer then copies instead.
NO_RENAME = frozenset({errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL,
                       errno.EACCES, errno.EBUSY})
_NETWORK = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "virtiofs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs"}
_DISK = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "ntfs", "ntfs3", "vfat", "exfat", "apfs", "hfs",
         "jfs", "reiserfs", "bcachefs"}
_CONTAINER = {"overlay", "aufs", "fuse-overlayfs"}
_MEMORY = {"tmpfs", "ramfs", "devtmpfs", "shm"}
_BUCKET_WORDS = ("hf-mount", "hf_mount", "huggingface", "xet", "bucket")


@dataclass(frozen=True)
class Storage:
    """The mount that holds `path`: where it is mounted, its file-system type and source, what kind of storage it
    is (bucket, network, disk, container, memory or unknown) and whether files there outlive a restart (None when
    that cannot be told)."""

    path: str
    mount_point: str
    fstype: str
    source: str
    kind: str
    persistent: bool | None

    def sentence(self) -> str:
        """One line for a user: where the runs are and what a restart does to them."""
        where = {"bucket": "a storage bucket", "network": "a network mount", "disk": "a disk",
                 "container": "the container's own files", "memory": "memory (tmpfs)"}.get(self.kind, "a mount")
        fate = {True: "they outlive a restart", False: "they are lost when the machine or container restarts",
                None: "whether they outlive a restart is unknown"}[self.persistent]
        return f"Runs in {self.path} are on {where} ({self.fstype} at {self.mount_point}): {fate}."


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) of every mount in a mountinfo file."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path(mountinfo).read_text(encoding="utf-8", errors="replace").splitlines():
            left, sep, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if sep and len(fields) >= 5 and len(rest) >= 2:
                found.append((_unescape(fields[4]), rest[0], rest[1]))
    return found


def _kind(fstype: str, source: str) -> tuple[str, bool | None]:
    base = fstype.split(".", 1)[0]
    words = f"{fstype} {source}".lower()
    if base in ("fuse", "fuseblk"):
        return ("bucket" if any(w in words for w in _BUCKET_WORDS) else "network"), True
    if base in _NETWORK:
        return "network", True
    if base in _DISK:
        return "disk", True
    if base in _CONTAINER:
        return "container", False
    if base in _MEMORY:
        return "memory", False
    return "unknown", None


def _within(path: str, mount_point: str) -> bool:
    return path == mount_point or mount_point == "/" or path.startswith(mount_point.rstrip("/") + "/")


def storage_of(path: str | Path, *, mountinfo: str = MOUNTINFO, bucket_mounts: Iterable[str] = ()) -> Storage:
    """The storage that holds `path` (which need not exist yet): the longest mount point above it in the mount
    table, symbolic links followed. A mount point in `bucket_mounts` is a bucket whatever its type says."""
    real = os.path.realpath(Path(path).expanduser().absolute())
    buckets = {os.path.realpath(b) for b in bucket_mounts}
    mounts = [m for m in _mounts(mountinfo) if _within(real, m[0])]
    if not mounts:
        return Storage(str(path), "", "unknown", "", "unknown", None)
    mount_point, fstype, source = max(mounts, key=lambda m: len(m[0]))
    kind, persistent = ("bucket", True) if mount_point in buckets else _kind(fstype, source)
    return Storage(str(path), mount_point, fstype, source, kind, persistent)


def renames_atomically(folder: str | Path) -> bool:
    """Whether `folder` lets a file be renamed over another and a folder be renamed (what the run folder's writes
    rely on), found by trying both on scratch names; False when either is refused."""
    root = Path(folder) / f".rename-probe-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True)
        (root / "a").write_text("new", encoding="utf-8")
        (root / "b").write_text("old", encoding="utf-8")
        os.replace(root / "a", root / "b")
        (root / "d.partial").mkdir()
        (root / "d.partial" / "f").write_text("x", encoding="utf-8")
        os.replace(root / "d.partial", root / "d")
        return (root / "b").read_text(encoding="utf-8") == "new" and not (root / "a").exists() \
            and (root / "d" / "f").is_file() and not (root / "d.partial").exists()
    except OSError as e:
        if e.errno in NO_RENAME:
            return False
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
