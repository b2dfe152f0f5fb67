"""`finetune doctor`: the versions, the machine and the self-test, as plain text or JSON, and the exit code (0 when
all is well, 2 with one sentence per problem)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from finetune.config import versions
from finetune.doctor import machine, selftest

EXIT_OK, EXIT_PROBLEMS = 0, 2


def findings(*, self_test: bool, device: str | None, folder: Path) -> dict[str, Any]:
    """Everything the doctor checks, with its problems (one sentence each)."""
    packages = versions.packages()
    found: dict[str, Any] = {"packages": [dataclasses.asdict(p) | {"ok": p.ok} for p in packages],
                             "machine": machine.facts(folder)}
    problems = [p for package in packages if (p := package.problem())]
    problems += machine.problems(found["machine"])
    if self_test:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        start = time.perf_counter()
        try:
            result = selftest.run(device)
        except Exception as e:  # noqa: BLE001 — a self-test that cannot run is the finding, said in one sentence
            problems.append(f"The self-test could not train on {device} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}): fix the problems above first, or "
                            "run `finetune doctor --no-self-test` to see the rest.")
            found["self_test"] = {"device": device, "error": f"{type(e).__name__}: {e}"[:500]}
        else:
            windows, peak = result["windows"], result["peak"]
            found["self_test"] = {"device": device, "seconds": round(time.perf_counter() - start, 1),
                                  "windows": [dataclasses.asdict(w) | {"ok": w.ok} for w in windows],
                                  "peak": dataclasses.asdict(peak) | {"error": peak.error, "ok": peak.ok}}
            for w in windows:
                if not w.ok:
                    problems.append(f"On {device} in {w.precision}, {len(selftest.LENGTHS) // selftest.MICRO} "
                                    f"micro-batches of {selftest.MICRO} did not train like one batch of "
                                    f"{len(selftest.LENGTHS)} (gradients differ by {w.relative_difference:.2e}, "
                                    f"more than {w.tolerance:.0e}): report it with `finetune doctor --json`.")
            if not peak.ok:
                problems.append(f"On {device} the planner predicted a peak of {peak.predicted / 2**20:.1f} MiB "
                                f"against {peak.measured / 2**20:.1f} MiB measured ({peak.error:+.1%}, outside "
                                f"{selftest.PEAK_WITHIN[0]:+.0%}…{selftest.PEAK_WITHIN[1]:+.0%}): plan with a "
                                "margin (a lower memory_budget_gb) and report it with `finetune doctor --json`.")
    found["problems"] = problems
    return found


def text(found: dict[str, Any]) -> str:
    """The findings as lines a person reads."""
    lines = ["packages (installed, supported):"]
    for p in found["packages"]:
        where = f" [{p['extra']}]" if p["extra"] else ""
        mark = "ok " if p["ok"] else "BAD"
        lines.append(f"  {mark} {p['name']}{where}: {p['found'] or 'not installed'} (needs {p['wanted'] or 'any'})")
    m = found["machine"]
    build = f"CUDA {m['cuda_build']} build" if m["cuda_build"] else "CPU build"
    lines.append(f"python {m['python']} on {m['platform']}; torch {m['torch']} ({build})")
    for d in m["devices"]:
        if d["device"] == "cpu":
            lines.append(f"device: cpu ({d['name']}, {d['cores']} cores), no GPU: runs train on the CPU; bf16 yes, "
                         "fp16 no (a GPU feature)")
        else:
            lines.append(f"device: {d['device']} {d['name']}, {d['memory_gib']:.1f} GiB ({d['free_gib']:.1f} free), "
                         f"compute {d['capability']}; bf16 {'yes' if d['bf16'] else 'no'}, fp16 yes")
    bnb = m["bitsandbytes"]
    backend = f", backend {bnb['backend']}" if bnb["backend"] else ""
    note = f" ({bnb['note']})" if bnb["note"] else ""
    lines.append(f"bitsandbytes: {bnb['version'] or 'not installed'}{backend}{note}")
    k = m["hub_kernels"]
    state = ("off (USE_HUB_KERNELS)" if k["disabled_by_environment"] else "usable" if k["usable"]
             else "not usable (no compatible `kernels` package)")
    lines.append(f"hub kernels: {state}; kernels package {k['kernels_package'] or 'not installed'}; Hub "
                 f"{'offline' if k['hub_offline'] else 'online if reachable'} (the `kernels` option decides per run)")
    lines.append(f"RAM {m['ram_gib']:.1f} GiB ({m['ram_available_gib']:.1f} available); disk "
                 f"{m['disk_free_gib']:.1f} GiB free under {m['disk_folder']}")
    test = found.get("self_test")
    if test and "error" not in test:
        lines.append(f"self-test on {test['device']} ({test['seconds']} s):")
        for w in test["windows"]:
            lines.append(f"  {'ok ' if w['ok'] else 'BAD'} {w['precision']}: {len(selftest.LENGTHS) // selftest.MICRO}"
                         f" micro-batches of {selftest.MICRO} ≡ 1 of {len(selftest.LENGTHS)}: gradients differ by "
                         f"{w['relative_difference']:.1e} (at most {w['tolerance']:.0e}), loss {w['loss']:.4f}")
        p = test["peak"]
        lines.append(f"  {'ok ' if p['ok'] else 'BAD'} planner: predicted peak {p['predicted'] / 2**20:.2f} MiB, "
                     f"measured {p['measured'] / 2**20:.2f} MiB ({p['error']:+.1%})")
    if found["problems"]:
        lines.append(f"{len(found['problems'])} problem(s):")
        lines += [f"  - {p}" for p in found["problems"]]
    else:
        lines.append("all is well")
    return "\n".join(lines)


def run_doctor(*, json_output: bool, self_test: bool, device: str | None, folder: Path | None = None) -> int:
    """Print the findings; 0 when all is well, 2 when there is a problem."""
    found = findings(self_test=self_test, device=device, folder=folder or Path.cwd())
    print(json.dumps(found, indent=2, default=str) if json_output else text(found), flush=True)
    return EXIT_PROBLEMS if found["problems"] else EXIT_OK
