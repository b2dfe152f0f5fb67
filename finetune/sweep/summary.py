"""A sweep's summary (summary.json: every trial, its parameters, how it ended and the best one) and its plot
(sweep.png: the objective against each searched option), from the study's trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.sweep.space import SweepSpec

# Optuna's trial states, as the summary, the trial's sweep.json and the Runs tab name them.
STATE_WORDS = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running",
               "WAITING": "waiting"}


def summarize(trials: list[Any], spec: SweepSpec, *, retried: set[int], name: str) -> dict[str, Any]:
    """The summary of a study's trials (Optuna's `FrozenTrial`s); a trial whose parameters were tried again (it was
    cut short) is listed as such and never the best."""
    rows = []
    for t in trials:
        state = "retried" if t.number in retried else STATE_WORDS[t.state.name]
        last = max(t.intermediate_values.items()) if t.intermediate_values else None
        rows.append({"number": t.number, "state": state, "params": t.params, "value": t.value,
                     "last_reported": None if last is None else {"step": last[0], "value": last[1]},
                     "run": t.user_attrs.get("run"), "reason": t.user_attrs.get("reason")})
    complete = [r for r in rows if r["state"] == "complete"]
    pick = max if spec.direction == "maximize" else min
    best = pick(complete, key=lambda r: r["value"]) if complete else None
    counts = {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "failed", "running", "waiting")}
    return {"sweep": name, "objective": spec.objective, "direction": spec.direction, "trials_wanted": spec.trials,
            "counts": {k: v for k, v in counts.items() if v}, "best": best, "trials": rows}


def plot_trials(summary: dict[str, Any], spec: SweepSpec, out: Path) -> None:
    """sweep.png: one panel per searched option, each trial's objective against its value (pruned trials at the
    last value they reported, hollow), the best trial starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = spec.space
    fig, axes = plt.subplots(1, len(params), figsize=(4 * len(params), 3.6), dpi=100, squeeze=False)
    best = summary["best"]
    for ax, p in zip(axes[0], params, strict=True):
        for state, style in (("complete", {"color": "tab:blue"}),
                             ("pruned", {"facecolors": "none", "edgecolors": "tab:gray"})):
            points = [(_x(r["params"][p.name], p), r["value"] if state == "complete" else r["last_reported"]["value"])
                      for r in summary["trials"] if r["state"] == state and p.name in r["params"]
                      and (state == "complete" or r["last_reported"])]
            if points:
                ax.scatter(*zip(*points, strict=True), label=state, **style)
        if best is not None:
            ax.scatter([_x(best["params"][p.name], p)], [best["value"]], marker="*", s=200, color="tab:red",
                       label=f"best (trial {best['number']})", zorder=3)
        if p.log:
            ax.set_xscale("log")
        ax.set_xlabel(p.name)
        ax.set_ylabel(spec.objective)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{summary['sweep']}: {spec.objective} ({spec.direction})")
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp")  # renamed when complete: a reader never sees half a picture
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)


def _x(value: Any, param: Any) -> Any:
    """A choice as a category (its text), a number where the option is a range."""
    return value if param.choices is None or isinstance(value, (int, float)) and not isinstance(value, bool) \
        else str(value)
