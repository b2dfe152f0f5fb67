"""The Jobs and storage-bucket part of the local Hub stand-in (tests/fakehub.py), for huggingface_hub's real client.

Jobs: `GET /api/jobs/hardware`, `POST /api/jobs/<ns>` (run_job), `GET /api/jobs/<ns>/<id>` (inspect_job),
`GET /api/jobs/<ns>/<id>/logs` (fetch_job_logs: server-sent events, replayed from the first line and held open
while the job runs, as the Hub's are), `POST /api/jobs/<ns>/<id>/cancel`. A job does not train: it plays a
`JobScript` the test gives (log lines, then files written into its bucket volume, then a final stage), reading its
config from the dataset volume the launcher committed, as a job reads `/inputs`.

Buckets: create (`POST /api/buckets/<ns>/<name>`), info, the tree (`/api/buckets/<id>/tree/<prefix>`), paths-info and
`/buckets/<id>/resolve/<path>`. Files are listed without a Xet hash, so the client downloads them over plain HTTP:
the Hub's Xet transfer protocol is not served (what that leaves untested: docs/jobs.md).
"""

from __future__ import annotations

import datetime
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import yaml

HARDWARE = [  # the shape of GET /api/jobs/hardware; the prices differ from the built-in table on purpose
    {"name": "cpu-basic", "prettyName": "CPU Basic", "cpu": "2 vCPU", "ram": "16 GB", "accelerator": None,
     "unitCostMicroUSD": 167, "unitCostUSD": 0.000167, "unitLabel": "minute"},
    {"name": "t4-small", "prettyName": "Nvidia T4 - small", "cpu": "4 vCPU", "ram": "15 GB",
     "accelerator": {"type": "gpu", "model": "T4", "quantity": "1", "vram": "16 GB", "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 7000, "unitCostUSD": 0.007, "unitLabel": "minute"},
    {"name": "a10g-largex2", "prettyName": "2x Nvidia A10G - large", "cpu": "24 vCPU", "ram": "92 GB",
     "accelerator": {"type": "gpu", "model": "A10G", "quantity": "2", "vram": "48 GB", "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 50000, "unitCostUSD": 0.05, "unitLabel": "minute"},
    {"name": "z100-huge", "prettyName": "Nvidia Z100", "cpu": "64 vCPU", "ram": "1 TB",
     "accelerator": {"type": "gpu", "model": "Z100", "quantity": "1", "vram": "200 GB", "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 100000, "unitCostUSD": 0.1, "unitLabel": "minute"},
]
TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")


@dataclass
class JobScript:
    """What a stand-in job does: prints `lines` (`delay` s apart; after `hold_after` lines it waits for `release`),
    then writes `files` (paths relative to its run folder) into its bucket and ends in `stage` with `message`,
    reporting `running_s` seconds of running (a job that ran into its time limit reports its limit)."""

    lines: list[str]
    stage: str = "COMPLETED"
    message: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    delay: float = 0.0
    hold_after: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    running_s: int | None = None


@dataclass
class FakeJob:
    """A job as the stand-in keeps it: the spec it was sent, its stage and the lines printed so far."""

    id: str
    namespace: str
    spec: dict[str, Any]
    stage: str = "SCHEDULING"
    message: str | None = None
    lines: list[str] = field(default_factory=list)
    running_s: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)
    script: JobScript | None = None  # what it plays, once it started
    created: float = field(default_factory=time.monotonic)  # when run_job made it
    ended: float | None = None  # when it reached its final stage

    def info(self, endpoint: str) -> dict[str, Any]:
        """The JobInfo the API answers (secrets by name only)."""
        spec = self.spec
        return {"id": self.id, "createdAt": "2026-01-01T00:00:00.000Z", "dockerImage": spec.get("dockerImage"),
                "spaceId": spec.get("spaceId"), "command": spec["command"], "arguments": spec.get("arguments"),
                "environment": spec.get("environment"), "secrets": dict.fromkeys(spec.get("secrets") or {}, "***"),
                "flavor": spec["flavor"], "labels": spec.get("labels"), "volumes": spec.get("volumes"),
                "status": {"stage": self.stage, "message": self.message},
                "durations": {"runningSecs": self.running_s}, "owner": {"id": "0" * 24, "name": self.namespace,
                                                                        "type": "user"}}


@dataclass
class FakeJobs:
    """Jobs and buckets. `script(job, config)` says what each new job does (`config`: the mapping it read from
    its /inputs/config.yaml); `buckets` maps a bucket id to its privacy and files."""

    script: Callable[[FakeJob, dict[str, Any]], JobScript] | None = None
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    buckets: dict[str, dict[str, Any]] = field(default_factory=dict)
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))
    refuse_runs: int | None = None  # answer run_job with this status (402: no credits)

    def most_at_once(self) -> int:
        """The most jobs that were ever between their creation and their end at the same moment."""
        edges = sorted([(j.created, 1) for j in self.jobs.values()] +
                       [(j.ended if j.ended is not None else float("inf"), -1) for j in self.jobs.values()],
                       key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
        most = now = 0
        for _, change in edges:
            now += change
            most = max(most, now)
        return most

    def only(self) -> FakeJob:
        """The one job started."""
        assert len(self.jobs) == 1, list(self.jobs)
        return next(iter(self.jobs.values()))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _volume(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(v for v in spec.get("volumes") or [] if v["type"] == kind)


def _play(hub: Any, job: FakeJob) -> None:
    """Run a stand-in job; one that cannot be played (no script, no config) ends in ERROR, as a broken job does."""
    try:
        _play_script(hub, job)
    except Exception as e:
        with job.changed:
            job.stage, job.message = "ERROR", f"stand-in job failed: {type(e).__name__}: {e}"
            job.ended = time.monotonic()
            job.changed.notify_all()
        raise


def _play_script(hub: Any, job: FakeJob) -> None:
    """Read the job's config from its dataset volume, print, write into its bucket volume, end."""
    inputs, bucket = _volume(job.spec, "dataset"), _volume(job.spec, "bucket")
    files = hub.repos[inputs["source"]]["files"]
    command_config = next(a for a in job.spec["command"] if a.startswith(inputs["mountPath"] + "/"))
    config = yaml.safe_load(files[f"{inputs['path']}/{command_config[len(inputs['mountPath']) + 1:]}"])
    script = job.script = hub.jobs.script(job, config)
    run_folder = config["output_dir"][len(bucket["mountPath"]) + 1:]

    def say(line: str) -> None:
        with job.changed:
            job.lines.append(line)
            job.changed.notify_all()

    job.stage = "RUNNING"
    for i, line in enumerate(script.lines):
        if job.cancelled.is_set():
            break
        if script.hold_after is not None and i == script.hold_after:
            while not (script.release.wait(0.05) or job.cancelled.is_set()):
                pass
            if job.cancelled.is_set():
                break
        say(line)
        time.sleep(script.delay)
    if not job.cancelled.is_set():
        for rel, data in script.files.items():
            hub.jobs.buckets[bucket["source"]]["files"][f"{run_folder}/{rel}"] = data
    with job.changed:
        if job.cancelled.is_set():
            job.stage, job.message = "CANCELED", None
        else:
            job.stage, job.message = script.stage, script.message
            job.running_s = script.running_s or job.running_s
        job.ended = time.monotonic()
        job.changed.notify_all()


def handle(request: Any, hub: Any, method: str) -> bool:
    """Answer a Jobs or bucket request; False when the route is not one of them."""
    url = urlparse(request.path)
    parts = [unquote(p) for p in url.path.split("/")]
    jobs: FakeJobs = hub.jobs
    user = request._user()
    if url.path.startswith("/api/jobs/") or url.path.startswith("/api/buckets/") or url.path.startswith("/buckets/"):
        if user is None:
            request._send(401, {"error": "Invalid credentials in Authorization header"})
            return True
    else:
        return False
    if url.path == "/api/jobs/hardware":
        request._send(200, HARDWARE)
        return True
    if parts[:3] == ["", "api", "jobs"]:
        return _jobs_route(request, hub, method, parts[3:], user)
    if parts[:3] == ["", "api", "buckets"]:
        return _bucket_api(request, jobs, method, parts[3:], parse_qs(url.query))
    if parts[:2] == ["", "buckets"] and len(parts) > 5 and parts[4] == "resolve":
        bucket = jobs.buckets.get(f"{parts[2]}/{parts[3]}")
        data = (bucket or {}).get("files", {}).get("/".join(parts[5:]))
        if data is None:
            request._send(404, {"error": "Entry not found"})
            return True
        request.send_response(200)
        request.send_header("content-length", str(len(data)))
        request.end_headers()
        if method == "GET":
            request.wfile.write(data)
        return True
    return False


def _jobs_route(request: Any, hub: Any, method: str, rest: list[str], user: tuple[str, str]) -> bool:
    jobs: FakeJobs = hub.jobs
    if user[1] != "write" and method == "POST":
        request._send(403, {"error": "This token has no write access"})
        return True
    namespace = rest[0]
    if len(rest) == 1 and method == "GET":  # list_jobs, by label
        labels = [v.partition("=") for v in parse_qs(urlparse(request.path).query).get("label", [])]
        request._send(200, [job.info(hub.url) for job in jobs.jobs.values() if job.namespace == namespace and all(
            (job.spec.get("labels") or {}).get(k) == v for k, _, v in labels)])
        return True
    if len(rest) == 1 and method == "POST":
        spec = json.loads(request._body())
        if jobs.refuse_runs:
            request._send(jobs.refuse_runs, {"error": "Payment required: add credits to run Jobs"})
            return True
        job = FakeJob(id=f"{next(jobs.counter):024x}", namespace=namespace, spec=spec)
        jobs.jobs[job.id] = job
        threading.Thread(target=_play, args=(hub, job), daemon=True).start()
        request._send(200, job.info(hub.url))
        return True
    job = jobs.jobs.get(rest[1]) if len(rest) > 1 else None
    if job is None or job.namespace != namespace:
        request._send(404, {"error": "Job not found"})
        return True
    if len(rest) == 2 and method == "GET":
        request._send(200, job.info(hub.url))
        return True
    if len(rest) == 3 and rest[2] == "cancel" and method == "POST":
        with job.changed:
            job.cancelled.set()
            job.changed.notify_all()
        request._send(200, {})
        return True
    if len(rest) == 3 and rest[2] == "logs" and method == "GET":
        _stream_logs(request, job)
        return True
    return False


def _stream_logs(request: Any, job: FakeJob) -> None:
    """Server-sent events: every line so far, then each new one, until the job ends; a keep-alive comment when
    nothing was printed for a second (the Hub sends one every 30 s)."""
    request.send_response(200)
    request.send_header("content-type", "text/event-stream")
    request.send_header("connection", "close")
    request.end_headers()
    sent = 0
    try:
        request.wfile.write(f"data: {json.dumps({'timestamp': _now(), 'data': '===== Job started ====='})}\n\n"
                            .encode())
        while True:
            with job.changed:
                if sent == len(job.lines) and job.stage not in TERMINAL:
                    job.changed.wait(1.0)
                new, sent = job.lines[sent:], len(job.lines)
                ended = job.stage in TERMINAL
            if not new and not ended:
                request.wfile.write(b": keep-alive\n\n")
            for line in new:
                request.wfile.write(f"data: {json.dumps({'timestamp': _now(), 'data': line})}\n\n".encode())
            request.wfile.flush()
            if ended:
                return
    except (BrokenPipeError, ConnectionResetError):  # the client went away (Ctrl-C, a killed launcher)
        return


def _bucket_api(request: Any, jobs: FakeJobs, method: str, rest: list[str], query: dict[str, list[str]]) -> bool:
    bucket_id = "/".join(rest[:2])
    if len(rest) == 2 and method == "POST":
        if bucket_id in jobs.buckets:
            request._send(409, {"error": "You already created this bucket",
                                "url": f"{request.hub_url}/buckets/{bucket_id}"})
            return True
        payload = json.loads(request._body() or b"{}")
        # huggingface_hub 2 sends `visibility`, 1.x `private` (both floors of pyproject.toml talk to it)
        private = payload.get("visibility") == "private" or payload.get("private") is True
        jobs.buckets[bucket_id] = {"private": private, "files": {}}
        request._send(200, {"url": f"{request.hub_url}/buckets/{bucket_id}"})
        return True
    bucket = jobs.buckets.get(bucket_id)
    if bucket is None:
        request._send(404, {"error": "Bucket not found"})
        return True
    if len(rest) == 2 and method == "GET":
        request._send(200, {"id": bucket_id, "private": bucket["private"], "createdAt": "2026-01-01T00:00:00Z",
                            "size": sum(len(v) for v in bucket["files"].values()),
                            "totalFiles": len(bucket["files"])})
        return True
    if len(rest) >= 3 and rest[2] == "tree" and method == "GET":
        prefix = "/".join(rest[3:]).strip("/")
        recursive = (query.get("recursive") or ["false"])[0].lower() == "true"
        request._send(200, _tree(bucket["files"], prefix, recursive))
        return True
    if len(rest) == 3 and rest[2] == "paths-info" and method == "POST":
        paths = json.loads(request._body())["paths"]
        request._send(200, [_file(p, bucket["files"][p]) for p in paths if p in bucket["files"]])
        return True
    return False


def _file(path: str, data: bytes) -> dict[str, Any]:
    return {"type": "file", "path": path, "size": len(data), "xetHash": None, "mtime": "2026-01-01T00:00:00Z"}


def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict[str, Any]]:
    under = {p: d for p, d in files.items() if not prefix or p.startswith(prefix + "/")}
    if recursive:
        folders = {"/".join(p.split("/")[:i]) for p in under for i in range(1, p.count("/") + 1)}
        folders = {f for f in folders if not prefix or f.startswith(prefix + "/")}
        return [*({"type": "directory", "path": f} for f in sorted(folders)),
                *(_file(p, d) for p, d in sorted(under.items()))]
    depth = prefix.count("/") + 1 if prefix else 0
    entries: dict[str, dict[str, Any]] = {}
    for p, d in sorted(under.items()):
        parts = p.split("/")
        if len(parts) == depth + 1:
            entries[p] = _file(p, d)
        else:
            folder = "/".join(parts[:depth + 1])
            entries[folder] = {"type": "directory", "path": folder}
    return list(entries.values())
