"""Copying a finished job's run folder from the bucket into the local one, so that `finetune eval`, `predict`,
`export` and the app's Try it use its model as a local run's.

Everything but the checkpoints is copied (they stay in the bucket, where a resumed job reads them), through
huggingface_hub's file system over the bucket (`hf://buckets/…`: Xet transfers on the Hub). The files land in
`.fetch.partial/` first and are moved into place once all of them arrived, so an interrupted fetch leaves the run
folder as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from huggingface_hub import HfFileSystem
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.errors import HTTPError as HubNetworkError

from finetune.config.schema import from_dict, read_yaml
from finetune.errors import FinetuneError
from finetune.remote.hfjobs import hub_token
from finetune.remote.inputs import local_view
from finetune.remote.jobfile import JobHandle, write_handle
from finetune.remote.mirror import Mirror
from finetune.run.events import read_events
from finetune.run.rundir import MARKER, plot_loss_in_background, write_text

STAGING = ".fetch.partial"


class FetchError(FinetuneError):
    """The job trained and saved its model in the bucket, but copying it here failed: exit 3 (as a failed push)."""

    exit_code = 3


# What `fetch` leaves in the bucket: the checkpoints (large; a resumed job reads them there).
NOT_FETCHED = ("checkpoints/",)


def fetch(handle: JobHandle, *, token: str | None = None) -> list[str]:
    """Copy the run folder from the bucket into the local one (all but the checkpoints): the model, metrics, plan
    and the job's config (its uploaded copies named by their local paths again). Returns the files copied."""
    token = hub_token(token)
    fs = HfFileSystem(endpoint=handle.endpoint, token=token)
    root = f"buckets/{handle.bucket}/{handle.remote_dir}"
    try:
        found = [p for p in fs.find(root) if not p.endswith("/")]
    except (HfHubHTTPError, HubNetworkError, OSError) as e:
        raise FetchError(f"Could not list {root} ({type(e).__name__}): the run is still in the bucket; fetch it "
                         f"again with `finetune jobs fetch {handle.run_dir}`.") from None
    relative = [p[len(root) + 1:] for p in found]
    wanted = [r for r in relative if r and not r.startswith(NOT_FETCHED)]
    if not any(r.startswith(("model/", "adapter/")) for r in wanted):
        raise FetchError(f"The bucket holds no model for this run ({root}): the job did not finish it.")
    staging = handle.run_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for rel in wanted:
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{rel}", str(target))
    except (HfHubHTTPError, HubNetworkError, OSError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise FetchError(f"Copying the run from the bucket failed ({type(e).__name__}): the run is still there; "
                         f"fetch it again with `finetune jobs fetch {handle.run_dir}`.") from None
    _settle(handle, staging)
    shutil.rmtree(staging, ignore_errors=True)
    write_handle(handle, fetched=sorted(wanted))
    if not (handle.run_dir / "loss.png").is_file():
        plot_loss_in_background(handle.run_dir)
    return sorted(wanted)


def _settle(handle: JobHandle, staging: Path) -> None:
    """Move what `fetch` downloaded into the run folder: folders replaced whole, the config made local, the
    events kept as mirrored unless the bucket's copy holds more."""
    for item in sorted(staging.iterdir()):
        target = handle.run_dir / item.name
        if item.name == MARKER:
            continue
        if item.name == "config.yaml":
            values = local_view(read_yaml(item), handle.uploads, str(handle.run_dir))
            write_text(target, from_dict(values).to_yaml())
        elif item.name == "events.jsonl":
            mirror = Mirror(handle.run_dir, handle.job_run_dir)
            remote = [mirror.localised(r) for r in read_events(item)]
            if len(remote) > len(read_events(target)):
                write_text(target, "".join(json.dumps(r) + "\n" for r in remote))
        elif item.is_dir():
            if target.exists():
                shutil.rmtree(target)
            item.replace(target)
        else:
            item.replace(target)
