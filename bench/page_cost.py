"""Benchmark: what an open page of the app costs the browser and the server, side by side in one run.

The app is served on this machine (`python -m app`, the bundled model and sample data); a headless Chromium opens
its page. Over the same window (`--seconds`) the script counts the CPU seconds of the browser (every Chromium process
it started) and of the app's server process alone (not its training child), in three states:

- `no page`: the app served, no page open;
- `idle page`: one page open, no run (the page's polls tick every five seconds, `app.follow`);
- `following a run`: the same page after Start training (Max steps 100,000: it outlasts the window), while the run
  trains (its poll ticks each second; the training child's own CPU is not counted). The run is stopped at the end.

    python bench/page_cost.py --seconds 30

Needs Playwright (`pip install playwright`, in the `test` extra) and a Chromium (`--chromium`, default
/usr/bin/chromium: Debian's `apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of one process so far (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def browser_pids(root: int) -> list[int]:
    """The Chromium processes below `root` (this script), however deep."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            names[int(entry.name)] = stat[stat.index("(") + 1:stat.rindex(")")]
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def below(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid, name in names.items() if name.startswith("chrom") and below(pid)]


def measure(app_pid: int, seconds: float) -> tuple[float, float]:
    """(browser CPU-s, app CPU-s) over the next `seconds` (a browser process that ends meanwhile counts until its
    last reading)."""
    pids = browser_pids(os.getpid())
    before = {pid: cpu_seconds(pid) for pid in pids}
    app_before = cpu_seconds(app_pid)
    last = dict(before)
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(min(1.0, max(end - time.time(), 0)))
        for pid in browser_pids(os.getpid()):
            last[pid] = max(last.get(pid, 0.0), cpu_seconds(pid))
    return sum(last.values()) - sum(before.values()), cpu_seconds(app_pid) - app_before


def serve(folder: Path) -> tuple[subprocess.Popen, str]:
    """`python -m app` on a free port with its runs in `folder`; (process, URL) once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONPATH": str(REPO_ROOT),
           "GRADIO_TEMP_DIR": str(folder / "gradio")}
    log = open(folder / "app.log", "w", encoding="utf-8")  # noqa: SIM115 (the app's for its whole life)
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--runs-dir", "runs"], cwd=folder,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"The app did not start: see {folder / 'app.log'}.")


def stop_training(runs: Path) -> None:
    """End the training child (it runs in a session of its own and would outlive the app), if one is left."""
    try:
        os.killpg(json.loads((runs / "current.json").read_text())["pid"], signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="the window of each state (default 30)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium to drive")
    args = parser.parse_args()
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        sys.exit("page_cost.py needs Playwright: pip install playwright (or the package's `test` extra).")
    if not Path(args.chromium).is_file():
        sys.exit(f"page_cost.py needs a Chromium at {args.chromium}: apt-get install chromium, or give --chromium.")
    rows = []
    with tempfile.TemporaryDirectory(prefix="page-cost-") as tmp:
        proc, url = serve(Path(tmp))
        try:
            time.sleep(5)  # the app settles after its first answer
            rows.append(("no page", None, measure(proc.pid, args.seconds)[1]))
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                start = page.get_by_role("button", name="Start training", exact=True)
                expect(start).to_be_enabled(timeout=120_000)
                time.sleep(10)  # the page's first events (the data's preview, the notes) are over
                rows.append(("idle page", *measure(proc.pid, args.seconds)))
                page.get_by_label("Max steps", exact=True).fill("100000")  # a run that outlasts the window
                start.click()
                expect(page.locator("#run-progress")).to_contain_text("step ", timeout=300_000)
                rows.append(("following a run", *measure(proc.pid, args.seconds)))
                page.get_by_role("button", name="Stop", exact=True).click()
                expect(page.locator("#run-status")).to_contain_text("Stopped", timeout=120_000)
                browser.close()
        finally:
            stop_training(Path(tmp) / "runs")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"CPU seconds over {args.seconds:.0f} s (and as a share of one core):")
    print(f"{'state':<18}{'browser':>18}{'app server':>18}")
    for state, browser_s, app_s in rows:
        shown = "—" if browser_s is None else f"{browser_s:.1f} ({browser_s / args.seconds:.0%})"
        print(f"{state:<18}{shown:>18}{f'{app_s:.1f} ({app_s / args.seconds:.0%})':>18}")


if __name__ == "__main__":
    main()
