"""What can be checked about the Dockerfile (and the Space's front matter) without a Docker engine."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT

from app.door.server import build_parser


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _all(kind: str) -> list[str]:
    return [args for word, args in instructions() if word == kind]


def _env() -> dict[str, str]:
    env = {}
    for args in _all("ENV"):
        env.update(dict(pair.split("=", 1) for pair in shlex.split(args)))
    return env


def test_slim_python_312_base_and_cpu_torch_before_the_package():
    assert _all("FROM") == ["python:3.12-slim"]
    args = dict(a.split("=", 1) for a in _all("ARG"))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # CUDA only when asked for
    runs = _all("RUN")
    torch = next(i for i, r in enumerate(runs) if "torch==" in r)
    package = next(i for i, r in enumerate(runs) if re.search(r"pip install \"?\.(\[|\s|$)", r))
    assert torch < package and "${TORCH_INDEX_URL}" in runs[torch]
    # The seq2seq extra is in the image: a task=seq2seq run's evaluation scores with its packages.
    assert 'pip install ".[seq2seq]"' in runs[package]
    for args in _all("COPY"):  # everything the image copies is in the repository
        for src in shlex.split(args)[:-1]:
            assert (ROOT / src).exists(), src


def test_runs_as_uid_1000_with_a_writable_home():
    useradd = next(r for r in _all("RUN") if "useradd" in r)
    user = re.search(r"--uid 1000 (\w+)", useradd).group(1)
    assert _all("USER") == [user]
    env = _env()
    home = env["HOME"]
    assert home == f"/home/{user}"
    mkdir = next(r for r in _all("RUN") if r.startswith("mkdir"))
    for key in ("HF_HOME", "GRADIO_TEMP_DIR", "FINETUNE_RUNS_DIR"):
        assert env[key].startswith(home + "/") and f"${key}" in mkdir


def test_docker_stop_gives_the_run_time_to_checkpoint_and_uploads_are_moved_not_copied():
    assert _all("STOPSIGNAL") == ["SIGTERM"]  # the app stops the run with a checkpoint on SIGTERM
    text = (ROOT / "Dockerfile").read_text()
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    commands = [line for page in pages for line in page.read_text().splitlines() if line.startswith("docker run ")]
    # Docker's 10 s is too short: every `docker run` the README and the docs show gives the run time to checkpoint.
    assert "--stop-timeout 120" in text and commands and all("--stop-timeout 120" in c for c in commands)
    env = _env()
    assert env["GRADIO_TEMP_DIR"].startswith(env["FINETUNE_RUNS_DIR"] + "/")  # one disk: an upload is moved


def test_listens_on_all_interfaces_at_7860_with_a_healthcheck():
    env = _env()
    assert env["GRADIO_SERVER_NAME"] == "0.0.0.0" and env["GRADIO_SERVER_PORT"] == "7860"
    assert _all("EXPOSE") == ["7860"]
    (check,) = _all("HEALTHCHECK")
    command = json.loads(check[check.index("CMD") + 3:])
    assert command[:2] == ["python", "-c"] and "urllib.request" in command[2] and ":7860/" in command[2]
    ast.parse(command[2])  # the probe is valid Python


def test_the_entry_command_is_a_real_command_of_the_app():
    (cmd,) = _all("CMD")
    argv = json.loads(cmd)
    assert argv == ["python", "-m", "app"]
    proc = subprocess.run([sys.executable, *argv[1:], "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout and "--runs-dir" in proc.stdout


def test_the_app_takes_host_port_and_runs_dir_from_the_images_environment(monkeypatch):
    for key in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "FINETUNE_RUNS_DIR"):
        monkeypatch.delenv(key, raising=False)
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.runs_dir) == ("127.0.0.1", 7860, "runs")  # local by default
    env = _env()
    for key in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "FINETUNE_RUNS_DIR"):
        monkeypatch.setenv(key, env[key])
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.runs_dir) == ("0.0.0.0", 7860, "/home/user/runs")


def test_readme_front_matter_makes_the_repo_a_docker_space():
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("---\n")
    meta = yaml.safe_load(readme.split("---\n", 2)[1])
    assert meta["sdk"] == "docker" and meta["app_port"] == 7860
    assert len(meta.get("short_description", "")) <= 60


def test_docker_context_leaves_out_local_state():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"runs", ".git"} <= set(ignored)


def test_readme_first_command_installs_and_opens_the_app():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1]
    first = quick_start.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert first.startswith("python -m pip install torch==2.13.0 -e . && ")
    command = first.split(" && ", 1)[1].split()
    assert command[:2] == ["finetune", "ui"]
    assert "finetune train assets/demo.yaml" in quick_start.split("## Using it", 1)[0]  # the CLI demo beside it
    args = build_parser().parse_args(command[2:])  # every flag it uses exists
    assert args.open and "![" in readme and (ROOT / "assets" / "screenshot.png").is_file()


@pytest.mark.slow
def test_a_space_starts_without_gradios_hot_reloader(tmp_path):
    """Gradio starts its Spaces hot-reloader wherever SYSTEM=spaces; without the `spaces` package (this image has
    none) every start logged a RuntimeError from its thread. The app turns the watcher off."""
    from conftest import served_app

    log = tmp_path / "app.log"
    space = {"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
             "OAUTH_CLIENT_ID": "x", "OAUTH_CLIENT_SECRET": "x", "OAUTH_SCOPES": "openid profile",
             "OPENID_PROVIDER_URL": "https://huggingface.co"}
    with served_app(tmp_path, log=log, **space) as (url, _):
        time.sleep(1)  # the watcher's thread starts beside the server's
    text = log.read_text()
    assert "hot-reloading" not in text and "Traceback" not in text, text


def test_llama_cpp_is_built_portable_wherever_it_is_installed():
    """llama-cpp-python compiles llama.cpp on install: for any x86-64 processor, not the build machine's own
    instruction set (a native build died of SIGILL on a virtual machine that advertises AVX-512 and AMX)."""
    from finetune.use.llamacpp import PORTABLE, REINSTALL

    flag = f'CMAKE_ARGS="{PORTABLE}"'
    assert _env()["CMAKE_ARGS"] == PORTABLE  # a `pip install "finetune[export]"` in the image, or one built on it
    ci = re.sub(r"\\\n\s*", "", (ROOT / ".ci" / "run").read_text())
    install = next(line for line in ci.splitlines() if "pip install" in line and ".[test]" in line)
    assert install.startswith(flag + " ")
    readme = (ROOT / "README.md").read_text()
    assert f'{flag} python -m pip install torch==2.13.0 -e ".[test]" && python -m pytest -q -n 2' in readme
    export_page = (ROOT / "docs" / "export.md").read_text()
    assert f'{flag} pip install "finetune[export]"' in export_page and "--force-reinstall --no-cache-dir" in REINSTALL
