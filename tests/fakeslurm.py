"""A stand-in Slurm for tests: `sbatch`, `squeue`, `sacct`, `scancel`, `scontrol`, `srun` and `sinfo` as one small
Python program (`fakeslurm.py COMMAND …`), put on the PATH by `install` as shell wrappers. Jobs live in
`$FAKE_SLURM_DIR/jobs/ID.json`; each job's batch script runs in a detached runner process, and `srun` starts one
process per "node" (node i is 127.0.0.(i+1), all on this machine), so a multi-node job really trains over gloo.
`scancel` ends a job (CANCELLED); `scontrol requeue` preempts it: its processes get SIGTERM, and the script starts
again with SLURM_RESTART_COUNT one higher, as Slurm does for a `--requeue` job. A job with `--time` and
`--signal=[B:]SIG@OFFSET` gets SIG that long before its limit (to its steps, `srun`, or with `B:` to the batch
script), on a clock sped up by `FAKE_SLURM_TIME_SCALE` (real seconds per Slurm second, default 1); the limit itself
is not enforced."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# As `sinfo -h -o "%P|%D|%G|%m|%f"` prints them: partition, nodes, GRES, RAM (MB), node features.
PARTITIONS = "debug*|2|(null)|16000|(null)\ngpu|4|gpu:h100:8(S:0-1)|512000|h100,h100_80gb,ib\n"
COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "scontrol", "srun", "sinfo")


def install(bin_dir: Path, state_dir: Path) -> dict[str, str]:
    """Write the wrappers into `bin_dir`; the environment variables that put them first on the PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state_dir)}


def _jobs() -> Path:
    folder = Path(os.environ["FAKE_SLURM_DIR"]) / "jobs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _load(job_id: str) -> dict:
    return json.loads((_jobs() / f"{job_id}.json").read_text())


def _save(job: dict) -> None:
    path = _jobs() / f"{job['id']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    tmp.replace(path)


def _options(script: str, argv: list[str]) -> dict[str, str]:
    values = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            argv = [line.split(None, 1)[1].strip(), *argv]
    for arg in argv:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            values[key] = value
    return values


def sbatch(argv: list[str]) -> int:
    script_path = Path(argv[-1])
    options = _options(script_path.read_text(), argv[:-1])
    partitions = {line.split("|")[0].rstrip("*"): line.split("|") for line in PARTITIONS.splitlines()}
    if options.get("partition") and options["partition"] not in partitions:
        print("sbatch: error: invalid partition specified", file=sys.stderr)
        return 1
    job_id = str(len(list(_jobs().glob("*.json"))) + 1000)
    _save({"id": job_id, "state": "PENDING", "script": str(script_path.resolve()), "options": options,
           "restarts": 0, "runner": None, "submitted": time.time(), "ended": None})
    subprocess.Popen([sys.executable, __file__, "_run", job_id], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(job_id)
    return 0


def _signal_at(options: dict[str, str]) -> tuple[float, signal.Signals, bool] | None:
    """When (real seconds after a start) and which signal `--signal` sends before `--time`, and whether to the
    batch script; None without both."""
    found = re.fullmatch(r"(B:)?(\w+)@(\d+)", options.get("signal", ""))
    if not found or not options.get("time"):
        return None
    parts = [int(x) for x in re.split(r"[-:]", options["time"])]
    limit_s = {1: 60 * parts[0], 2: 60 * parts[0] + parts[1], 3: 3600 * parts[0] + 60 * parts[1] + parts[2]}[len(parts)]
    name = found.group(2) if found.group(2).startswith("SIG") else f"SIG{found.group(2)}"
    scale = float(os.environ.get("FAKE_SLURM_TIME_SCALE", "1"))
    return (limit_s - int(found.group(3))) * scale, signal.Signals[name], bool(found.group(1))


def _send_before_limit(job_id: str, child: subprocess.Popen, when: tuple[float, signal.Signals, bool]) -> None:
    """Slurm's signal before the time limit: to the batch script, or to the job's step (the `srun` running now)."""
    _, sig, to_batch = when
    step = _jobs() / f"{job_id}.step"
    pid = child.pid if to_batch or not step.is_file() else int(step.read_text())
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _cancelled(job_id: str) -> Path:
    """Where `scancel` leaves its word for the job's runner: read before each start and while the job runs, so that
    a cancel sent before the runner had said where it is (a pending job, as Slurm's own scancel ends one) is kept."""
    return _jobs() / f"{job_id}.cancel"


def _run(job_id: str) -> int:
    """The job's life: its script, again after each requeue, until it ends or is cancelled."""
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("cancel"))
    signal.signal(signal.SIGUSR1, lambda *_: asked.append("requeue"))
    while True:
        job = _load(job_id)
        if _cancelled(job_id).exists():  # cancelled while pending: it never starts
            _save({**job, "state": "CANCELLED", "exit_code": None, "ended": time.time()})
            return 0
        options = job["options"]
        nodes = int(options.get("nodes") or 1)
        env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
               "SLURM_JOB_NODELIST": ",".join(f"127.0.0.{i + 1}" for i in range(nodes)),
               "SLURM_RESTART_COUNT": str(job["restarts"])}
        output = options.get("output", "slurm-%j.out").replace("%j", job_id)
        _save({**job, "state": "RUNNING", "runner": os.getpid()})
        with open(output, "a") as log:
            child = subprocess.Popen(["bash", job["script"]], cwd=options.get("chdir") or None, env=env,
                                     stdout=log, stderr=log, start_new_session=True)
            started, when = time.monotonic(), _signal_at(options)
            while child.poll() is None and not asked:
                if _cancelled(job_id).exists():
                    asked.append("cancel")
                    break
                if when is not None and time.monotonic() - started >= when[0]:
                    _send_before_limit(job_id, child, when)
                    when = None  # once per start
                time.sleep(0.1)
            if asked:  # Slurm signals every process of the job, then kills what is left
                try:
                    os.killpg(child.pid, signal.SIGTERM)  # gone already: the script requeued itself and exited
                    child.wait(timeout=30)
                except ProcessLookupError:
                    pass
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        job = _load(job_id)
        if asked and asked[-1] == "requeue":
            asked.clear()
            _save({**job, "state": "PENDING", "restarts": job["restarts"] + 1})
            continue
        state = "CANCELLED" if asked else "COMPLETED" if child.returncode == 0 else "FAILED"
        _save({**job, "state": state, "exit_code": child.returncode, "ended": time.time()})
        return 0


def most_at_once(jobs: list[dict]) -> int:
    """The most jobs that were ever between their submission and their end at the same moment (jobs as
    `$FAKE_SLURM_DIR/jobs/*.json` record them)."""
    edges = sorted([(j["submitted"], 1) for j in jobs] + [(j["ended"] or float("inf"), -1) for j in jobs])
    most = now = 0
    for _, change in edges:
        now += change
        most = max(most, now)
    return most


def srun(argv: list[str]) -> int:
    """One task per node, each with its SLURM_PROCID/SLURM_NODEID; the first to fail ends the others."""
    command = [a for a in argv if not a.startswith("--")]
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    if os.environ.get("SLURM_JOB_ID"):  # where the runner finds the job's step, to signal it before the limit
        (_jobs() / f"{os.environ['SLURM_JOB_ID']}.step").write_text(str(os.getpid()))
    tasks = [subprocess.Popen(command, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_NODEID": str(i),
                                           "SLURM_LOCALID": "0", "SLURMD_NODENAME": f"127.0.0.{i + 1}"})
             for i in range(nodes)]
    signal.signal(signal.SIGTERM, lambda *_: [t.send_signal(signal.SIGTERM) for t in tasks if t.poll() is None])
    while any(t.poll() is None for t in tasks):
        if any(t.poll() not in (None, 0) for t in tasks):
            for t in tasks:
                if t.poll() is None:
                    t.terminate()
        time.sleep(0.1)
    return next((t.returncode for t in tasks if t.returncode), 0)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "_run":
        return _run(args[0])
    if command == "sbatch":
        return sbatch([a for a in args if a != "--parsable"])
    if command == "srun":
        return srun(args)
    if command == "sinfo":
        print(PARTITIONS, end="")
        return 0
    if command == "scontrol" and args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))
        return 0
    job_id = next((a for a in args if a.isdigit()), None)
    if job_id is None or not (_jobs() / f"{job_id}.json").is_file():
        print(f"{command}: error: Invalid job id specified", file=sys.stderr)
        return 1
    job = _load(job_id)
    if command == "squeue":
        if job["state"] in ("PENDING", "RUNNING"):
            print(job["state"])
        return 0
    if command == "sacct":
        print(job["state"])
        return 0
    signal_ = signal.SIGUSR1 if command == "scontrol" and args[0] == "requeue" else signal.SIGTERM
    if signal_ == signal.SIGTERM and job["state"] in ("PENDING", "RUNNING"):
        _cancelled(job_id).touch()  # a runner that has not started yet finds it
    if job["state"] in ("PENDING", "RUNNING") and job.get("runner"):
        os.kill(job["runner"], signal_)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
