"""Where a run folder lives (finetune.run.storage) and writing it on a mount that cannot rename: a checkpoint copied
into place counts only once complete, a crash mid-copy leaves the previous one the newest, and a training run on
such a mount checkpoints and resumes."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from conftest import assert_same_weights, load_weights

from finetune.config.schema import from_dict
from finetune.run import rundir
from finetune.run.events import Step
from finetune.run.storage import renames_atomically, storage_of
from finetune.train.loop import StopFlag, train

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
23 22 0:22 / /proc rw - proc proc rw
24 22 0:23 / /dev/shm rw - tmpfs shm rw
25 22 8:1 /srv /home/user/runs rw - ext4 /dev/sda1 rw
26 22 0:40 / /data rw,nosuid - fuse hf-mount rw,user_id=1000
27 22 0:41 / /mnt/my\\040share rw - nfs4 server:/export rw
28 22 0:42 / /mnt/sshfs rw - fuse.sshfs me@host:/x rw
29 22 0:43 / /runs rw - fuse something rw
"""


@pytest.fixture
def mountinfo(tmp_path):
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return str(path)


@pytest.mark.parametrize(("path", "kind", "persistent", "mount"), [
    ("/data/runs/demo", "bucket", True, "/data"),  # a FUSE mount named after the Hub's mount
    ("/home/user/runs/x", "disk", True, "/home/user/runs"),
    ("/home/user/other", "container", False, "/"),  # the container's own layer: gone when it is replaced
    ("/dev/shm/runs", "memory", False, "/dev/shm"),
    ("/mnt/my share/runs", "network", True, "/mnt/my share"),  # an escaped space in the mount point
    ("/mnt/sshfs/r", "network", True, "/mnt/sshfs"),  # some other FUSE mount
    ("/datax/runs", "container", False, "/"),  # a prefix of a mount point's name is not inside it
])
def test_storage_of_reads_the_mount_table(mountinfo, path, kind, persistent, mount):
    found = storage_of(path, mountinfo=mountinfo)
    assert (found.kind, found.persistent, found.mount_point) == (kind, persistent, mount)
    assert found.sentence().startswith(f"Runs in {path} are on ")


def test_a_mount_known_to_be_a_bucket_is_one_whatever_its_type(mountinfo):
    assert storage_of("/runs/demo", mountinfo=mountinfo).kind == "network"
    assert storage_of("/runs/demo", mountinfo=mountinfo, bucket_mounts=["/runs"]).kind == "bucket"


def test_storage_of_this_machine_and_an_unreadable_table(tmp_path):
    here = storage_of(tmp_path / "not" / "made" / "yet")  # the nearest existing parent's mount
    assert here.mount_point and here.fstype != "unknown"
    assert storage_of(tmp_path, mountinfo=str(tmp_path / "missing")).persistent is None


def test_renames_are_probed(tmp_path, monkeypatch):
    tmp_path = tmp_path / "mount"  # tmp_path itself holds the test's cache folder (conftest's shared converters)
    tmp_path.mkdir()
    assert renames_atomically(tmp_path)
    real = os.replace

    def no_folder_renames(src, dst):
        if os.path.isdir(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", no_folder_renames)
    assert not renames_atomically(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe cleans up


@pytest.fixture
def no_folder_renames(monkeypatch):
    """A mount like an object store's: files are renamed, folders are refused (EXDEV)."""
    real = os.replace

    def replace(src, dst):
        if os.path.isdir(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(rundir.os, "replace", replace)


def _partial(run_dir, step):
    path = rundir.checkpoint_path(run_dir, step)
    partial = rundir.partial_checkpoint(path)
    (partial / "sub").mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"w" * 10)
    (partial / "sub" / "state.json").write_text("{}")
    return partial, path


def test_a_checkpoint_is_copied_in_where_folders_do_not_rename(tmp_path, no_folder_renames):
    partial, path = _partial(tmp_path, 1)
    rundir.commit_checkpoint(partial, path)
    assert rundir.checkpoints(tmp_path) == [path] and not partial.exists()
    assert (path / "sub" / "state.json").read_text() == "{}" and not (path / rundir.INCOMPLETE).exists()


def test_a_copy_cut_short_is_never_a_checkpoint(tmp_path, no_folder_renames, monkeypatch):
    first, first_path = _partial(tmp_path, 1)
    rundir.commit_checkpoint(first, first_path)
    second, second_path = _partial(tmp_path, 2)

    def disk_gone(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shutil, "copy2", disk_gone)
    with pytest.raises(OSError):
        rundir.commit_checkpoint(second, second_path)
    assert second_path.is_dir() and (second_path / rundir.INCOMPLETE).exists()
    assert rundir.checkpoints(tmp_path) == [first_path]  # resume reads the complete one
    rundir.remove_partial_checkpoints(tmp_path)
    assert not second_path.exists() and not second.exists() and first_path.is_dir()


def test_files_are_written_in_place_where_nothing_renames(tmp_path, monkeypatch):
    def refuse(self, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(rundir.Path, "replace", refuse)
    rundir.write_json(tmp_path / "metrics.json", {"accuracy": 1.0})
    assert (tmp_path / "metrics.json").read_text() == '{\n  "accuracy": 1.0\n}\n'
    assert not (tmp_path / "metrics.json.tmp").exists()


@pytest.mark.slow
def test_training_checkpoints_and_resumes_where_folders_do_not_rename(tmp_path, tiny_bert, cls_csv,
                                                                     no_folder_renames):
    base = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "max_steps": 4, "save_every": 2,
            "optimizer": "sgd", "learning_rate": 0.5, "warmup_ratio": 0.0, "eval_fraction": 0.0, "precision": "fp32"}
    whole = train(from_dict({**base, "output_dir": str(tmp_path / "whole")}))
    stop = StopFlag()
    cut = from_dict({**base, "output_dir": str(tmp_path / "cut")})
    stopped = train(cut, stop=stop, callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 3
                                               else None])
    assert stopped.status == "stopped"
    assert [p.name for p in rundir.checkpoints(tmp_path / "cut")] == ["step-0000002", "step-0000003"]
    assert not list((tmp_path / "cut" / "checkpoints").glob(f"*/{rundir.INCOMPLETE}"))
    resumed = train(cut.replace(resume=True))
    assert whole.status == resumed.status == "done"
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "whole"))
