"""The planner child: `finetune plan --json` on a config, and its answers remembered by config, so that Plan then
Start on the same form plans once (and picking a model, then Plan, too)."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Hashable, Mapping
from pathlib import Path
from subprocess import TimeoutExpired
from typing import Any

from app.door import limits
from app.local import children
from app.mapping import config_yaml
from app.results import Unanswered
from finetune.config.schema import FIELDS, Config

PLAN_TIMEOUT_S = 120
PLAN_MEMO = 16  # plans (or planner errors) kept per app, by config: Start reuses what Plan just answered
PLANNER_SLOW = "The planner took longer than"
PROBE_OFF = "Estimated without a measured probe while another job (a run or an export) uses the device."


class Planner:
    """`finetune plan` in a child process, with a memo of its latest answers (a plan, or the planner's refusal)."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, dict[str, Any] | str] = {}

    def plan(self, config: Config, key: Hashable, *, device: str, training: bool, env: Mapping[str, str]
             ) -> dict[str, Any]:
        """The plan of `config` for `device` ("here" or "cuda"), remembered under `key`; `Unanswered` with the
        planner's sentence. While a run is `training`, the plan is estimated without a measured probe (not
        remembered: the next one may measure)."""
        if key in self._plans:  # Plan, then Start on the same form: one planner run, not two
            answer = self._plans[key]
            if isinstance(answer, str):
                raise Unanswered(answer)
            return dict(answer)
        try:
            plan = self.run(config, device, training, env)
        except Unanswered as e:
            if not str(e).startswith(PLANNER_SLOW):
                self._remember(key, str(e))
            raise
        if not plan.get("notes") or PROBE_OFF not in plan["notes"]:
            self._remember(key, plan)
        return plan

    def _remember(self, key: Hashable, answer: dict[str, Any] | str) -> None:
        self._plans[key] = answer
        while len(self._plans) > PLAN_MEMO:
            self._plans.pop(next(iter(self._plans)))

    @staticmethod
    def run(config: Config, device: str = "here", training: bool = False, env: Mapping[str, str] | None = None
            ) -> dict[str, Any]:
        """`finetune plan --json` in a child process: the plan.json mapping, or `Unanswered`."""
        extra = ["--device", "cuda"] if device == "cuda" else []
        if training and "plan_probe" in FIELDS:
            # A measured probe would train on the device the running job is using: estimate without one.
            extra = ["plan_probe=false", *extra]
        with tempfile.TemporaryDirectory(prefix="finetune-plan-") as tmp:
            cfg_path, out_path = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
            cfg_path.write_text(config_yaml(config), encoding="utf-8")
            try:
                proc = children.run([sys.executable, "-m", "finetune", "plan", str(cfg_path), *extra, "--json",
                                     str(out_path)], PLAN_TIMEOUT_S, env or {})
            except TimeoutExpired:
                raise Unanswered(f"{PLANNER_SLOW} {PLAN_TIMEOUT_S} s.") from None
            if proc.returncode != 0 or not out_path.is_file():
                text = (proc.stderr or proc.stdout).strip().splitlines()
                message = next((line[len("error: "):] for line in reversed(text) if line.startswith("error: ")),
                               None)
                raise Unanswered(limits.short_text(message or (text[-1] if text else "The planner failed.")))
            plan = json.loads(out_path.read_text(encoding="utf-8"))
        if "plan_probe=false" in extra:
            plan["notes"] = [*plan.get("notes", []), PROBE_OFF]
        return plan
