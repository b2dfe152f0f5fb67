"""Slurm's commands, read and written: the partitions (`sinfo`), a request checked against them, the batch script,
and submitting (`sbatch`), reading (`squeue`, `sacct`) and cancelling (`scancel`) a job.

Every refusal is one sentence before anything is submitted: no `sbatch` on the PATH, an unknown partition, more
nodes or GPUs per node than the partition has, a time limit Slurm cannot read."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import ConfigError, FinetuneError
from finetune.remote.backend import Hardware
from finetune.run.rundir import MARKER

SCRIPT = "slurm.sbatch"  # in the run folder: what was submitted
CONFIG = "slurm.yaml"  # in the run folder: the config every node runs
LOG = "slurm.log"  # in the run folder: the job's output, appended to by each requeued start
# Slurm's states of a job that has not ended (squeue); anything else sacct reports is an end.
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
          "REQUEUE_FED", "PREEMPTED", "SIGNALING", "STAGE_OUT", "STOPPED")
COMMAND_TIMEOUT_S = 60
# GB of one GPU of a GRES type (`gpu:h100:8`) when no node feature says it: the smaller size of a model sold in two
# (A100 40/80, V100 16/32), so that a plan made for it fits either.
GPU_MEMORY_GB = {"h200": 141, "h100": 80, "gh200": 96, "a100": 40, "a40": 48, "a10": 24, "a10g": 24, "l40s": 48,
                 "l40": 48, "l4": 24, "t4": 16, "v100": 16, "a6000": 48, "rtx6000": 24, "mi300x": 192, "mi250x": 128}


class SlurmError(FinetuneError):
    """A Slurm command failed after the request was checked; the message says what it printed (exit 1)."""


@dataclass(frozen=True)
class Partition:
    """One partition as `sinfo` lists it: its nodes, the GPUs of each (0: none listed) and RAM per node (MB)."""

    name: str
    nodes: int
    gpus: int
    ram_mb: int | None
    default: bool = False
    gpu_type: str | None = None  # GRES's type (`gpu:a100:8`), when it names one
    gpu_memory_gb: float | None = None  # GB of one GPU: a node feature's (`h100_80gb`), else its type's; None: unknown


@dataclass(frozen=True)
class Request:
    """What `--backend slurm`'s options ask for."""

    nodes: int = 1
    gpus_per_node: int = 1
    partition: str | None = None
    time: str | None = None
    gpu_memory_gb: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Request:
        """The request of `finetune train`'s options (their defaults where not given)."""
        return cls(nodes=1 if args.nodes is None else args.nodes,
                   gpus_per_node=1 if args.gpus_per_node is None else args.gpus_per_node,
                   partition=args.partition, time=args.time, gpu_memory_gb=args.gpu_memory)


@dataclass(frozen=True)
class Checked:
    """A request Slurm will take: the partition it goes to, the hardware it gives, its time limit in seconds."""

    request: Request
    partition: Partition
    hardware: Hardware
    time_s: int | None


def _run(command: list[str], what: str) -> str:
    """A Slurm command's output; `SlurmError` with what it said when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise ConfigError([f"Slurm's {command[0]} is not on the PATH: run this on the cluster's login node (or "
                           "load its Slurm module)."]) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"Slurm's {command[0]} did not answer in {COMMAND_TIMEOUT_S} s: the controller may be "
                         f"down; try again ({what}).") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SlurmError(f"Could not {what}: Slurm's {command[0]} said {said!r}.")
    return done.stdout


def gpu_memory_gb(features: str, gpu_type: str | None) -> float | None:
    """GB of one GPU of a node, from its features (`sinfo`'s %f): one that names the GPU (its GRES type, or `gpu`)
    and ends in its memory (`h100_80gb`, `gpu80g`, `gpumem_80G`); else the type's in `GPU_MEMORY_GB`; else None."""
    names = ("gpu", gpu_type.lower()) if gpu_type else ("gpu",)
    for feature in features.lower().split(","):
        found = re.search(r"(\d+(?:\.\d+)?)gi?b?$", feature.strip())
        if found and any(n in feature[:found.start()] for n in names):
            return float(found.group(1))
    return GPU_MEMORY_GB.get((gpu_type or "").lower())


def partitions() -> list[Partition]:
    """The cluster's partitions (`sinfo`), the default one marked; a partition's GPUs are those of its largest kind
    of node, their memory the smallest any of its kinds of node says."""
    found: dict[str, Partition] = {}
    for line in _run(["sinfo", "-h", "-o", "%P|%D|%G|%m|%f"], "list the partitions").splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        name, nodes, gres, ram, features = parts
        listed = [(int(m.group(2)), m.group(1)) for m in re.finditer(r"gpu(?::([^:,(]+))?:(\d+)", gres)]
        gpus, gpu_type = max(listed, default=(0, None))
        default = name.endswith("*")
        name = name.rstrip("*")
        ram_mb = int(re.sub(r"\D", "", ram)) if re.sub(r"\D", "", ram) else None
        memory = gpu_memory_gb(features, gpu_type) if gpus else None
        before = found.get(name)  # sinfo lists a partition once per kind of node: keep the largest
        if before is not None and before.gpu_memory_gb is not None:
            memory = before.gpu_memory_gb if memory is None else min(memory, before.gpu_memory_gb)
        if before is None or (gpus, int(nodes)) > (before.gpus, before.nodes):
            found[name] = Partition(name, int(nodes), gpus, ram_mb, default or bool(before and before.default),
                                    gpu_type, memory)
        else:
            found[name] = dataclasses.replace(before, gpu_memory_gb=memory)
    return list(found.values())


def time_seconds(text: str) -> int:
    """Slurm's time format (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; one sentence for other text."""
    found = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if found is None:
        raise ConfigError([f"--time {text!r} is not a Slurm time limit: write it as Slurm does, e.g. 4:00:00 "
                           "(hours), 90 (minutes) or 1-00:00:00 (a day)."])
    days, a, b, c = found.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
    elif c is not None:
        hours, minutes, seconds = int(a), int(b), int(c)
    elif b is not None:  # M:S
        hours, minutes, seconds = 0, int(a), int(b)
    else:
        hours, minutes, seconds = 0, int(a), 0
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_request(request: Request) -> Checked:
    """The request against the cluster; one sentence for what Slurm would reject."""
    if shutil.which("sbatch") is None:
        raise ConfigError(["Slurm's sbatch is not on the PATH: run this on the cluster's login node (or load its "
                           "Slurm module)."])
    if request.nodes < 1 or request.gpus_per_node < 0:
        raise ConfigError(["--nodes must be at least 1 and --gpus-per-node at least 0."])
    if request.gpu_memory_gb is not None and request.gpu_memory_gb <= 0:
        raise ConfigError([f"--gpu-memory is the GB of one of the partition's GPUs (80 for an 80 GB A100); "
                           f"{request.gpu_memory_gb:g} is none."])
    known = partitions()
    if request.partition:
        partition = next((p for p in known if p.name == request.partition), None)
        if partition is None:
            raise ConfigError([f"Partition {request.partition!r} is not on this cluster: choose one of "
                               f"{', '.join(p.name for p in known)} (`sinfo` lists them)."])
    else:
        partition = next((p for p in known if p.default), known[0] if known else None)
        if partition is None:
            raise ConfigError(["This cluster lists no partitions (`sinfo` printed none): give --partition."])
    if request.nodes > partition.nodes:
        raise ConfigError([f"Partition {partition.name!r} has {partition.nodes} node(s): --nodes {request.nodes} "
                           "asks for more."])
    if request.gpus_per_node > partition.gpus:
        raise ConfigError([f"The nodes of partition {partition.name!r} have {partition.gpus} GPU(s) each: "
                           f"--gpus-per-node {request.gpus_per_node} asks for more."])
    time_s = time_seconds(request.time) if request.time else None
    ram = partition.ram_mb / 1000 if partition.ram_mb else None
    # --gpu-memory wins over what `sinfo` says (a feature, or the GPU type's size).
    hardware = Hardware(request.nodes, request.gpus_per_node, request.gpu_memory_gb or partition.gpu_memory_gb, ram)
    return Checked(request, partition, hardware, time_s)


def grace_s(time_s: int) -> int:
    """How long before the time limit the run is asked to stop (SIGTERM: a checkpoint, then exit): a tenth of the
    limit, between 1 and 10 minutes (Slurm's `--signal` takes at most 65535 s)."""
    return int(min(max(0.1 * time_s, 60), 600, time_s / 2))


def script(checked: Checked, *, run_dir: Path, name: str, workdir: Path, python: str = sys.executable) -> str:
    """The batch script: the shared run folder checked on the first node, `resume=true` when the folder holds a
    checkpoint (a requeued job), then `srun` starting one launcher per node: `accelerate launch` with the first
    node as the main process and `SLURM_NODEID` as the machine rank, or plain `finetune train` for one process.
    A run that stopped with a new checkpoint at the signal before the time limit requeues the job."""
    r, hw = checked.request, checked.hardware
    config, log, events = (shlex.quote(str(run_dir / n)) for n in (CONFIG, LOG, "events.jsonl"))
    steps = shlex.quote(str(run_dir / "checkpoints" / "step-[0-9]*[0-9]"))  # the checkpoints, as a glob
    lines = ["#!/bin/bash", f"#SBATCH --job-name=finetune-{name}", f"#SBATCH --partition={checked.partition.name}",
             f"#SBATCH --nodes={r.nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --chdir={workdir}",
             f"#SBATCH --output={run_dir / LOG}", "#SBATCH --open-mode=append", "#SBATCH --requeue"]
    if r.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={r.gpus_per_node}")
    if checked.time_s:
        # The signal goes to the job's steps (srun passes it to each launcher): the run checkpoints and stops.
        lines += [f"#SBATCH --time={r.time}", f"#SBATCH --signal=TERM@{grace_s(checked.time_s)}"]
    launcher = f"{shlex.quote(python)} -m finetune"
    if hw.processes > 1:
        launcher = (f"{shlex.quote(python)} -m accelerate.commands.launch --multi_gpu --num_machines {r.nodes} "
                    f"--machine_rank $SLURM_NODEID --num_processes {hw.processes} --main_process_ip $MAIN "
                    "--main_process_port $PORT --mixed_precision no --dynamo_backend no -m finetune")
    task = f"exec {launcher} train {config} $RESUME -q"
    lines += [
        "set -u",
        "export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1",
        f"if [ ! -f {shlex.quote(str(run_dir / MARKER))} ]; then",
        f'  echo "error: the run folder {run_dir} is not visible on $(hostname): put output_dir on a filesystem '
        'that every node shares (home or a parallel filesystem), then submit again."',
        "  exit 2",
        "fi",
        f"newest() {{ compgen -G {steps} | sort | tail -n 1; }}",
        "RESUME=",
        # compgen, not ls: a checkpoint the run is pruning may vanish while ls reads it, and ls then fails.
        f"if compgen -G {steps} >/dev/null; then "
        "RESUME=resume=true",
        # A requeued start before the first checkpoint: what the earlier start wrote is started over.
        'elif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=overwrite=true; fi',
        'MAIN=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "export MAIN PORT RESUME",
        f"echo \"finetune: job $SLURM_JOB_ID start ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, main $MAIN:$PORT"
        f"${{RESUME:+, resuming}}\" >> {log}",
        "NEWEST_BEFORE=$(newest)",
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(task)}",
        "CODE=$?",
        # The run stopped with a checkpoint (its last event) at the signal before the time limit: a cancel or a
        # preemption ends this script before it gets here. Requeued, the job starts again with a full time limit
        # and resumes from it; only when the checkpoint is new, so that a start that cannot reach a step does not
        # loop. (Its last event, not the exit code: accelerate's launcher exits 1 for a stopped run too.)
        f'if [ "$CODE" -ne 0 ] && [ "$(newest)" != "$NEWEST_BEFORE" ] && tail -n 1 {events} | grep -q \'"event": '
        '"stopped"\'; then',
        f'  echo "finetune: job $SLURM_JOB_ID stopped with a checkpoint before its time limit; requeued to resume '
        f'from $(basename "$(newest)")" >> {log}',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$CODE"',
    ]
    return "\n".join(lines) + "\n"


def submit(script_path: Path) -> str:
    """`sbatch` the script; the job's id."""
    out = _run(["sbatch", "--parsable", str(script_path)], "submit the job")
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {out.strip()!r} instead of a job id.")
    return job_id


def state(job_id: str) -> str:
    """The job's state: from `squeue` while it is queued or running, else its end from `sacct`."""
    try:
        now = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], "read the job's state").strip()
    except SlurmError:  # squeue forgets a job soon after it ends ("Invalid job id")
        now = ""
    if now:
        return now.split()[0]
    ended = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], "read how the job ended").split()
    return ended[0] if ended else "UNKNOWN"


def cancel(job_id: str) -> None:
    """`scancel` the job."""
    _run(["scancel", job_id], f"cancel job {job_id}")
