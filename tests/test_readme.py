"""The README's examples run as written, so the docs cannot rot: `kb demo --no-serve` (the shipped
history, its hypotheses and the job it runs), then every command of the "Try it after the demo"
block and its Python example, in a fresh folder."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")


def blocks(section: str, lang: str) -> list[str]:
    text = README.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_readme_demo_and_examples_run(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("KB_HOME", None)
    env.pop("KB_DATABASE_URL", None)
    env.pop("KB_DEMO_STEPS", None)
    demo = subprocess.run([KB, "demo", "--no-serve"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert demo.returncode == 0, demo.stderr
    assert "d1-lr1" in demo.stdout and "d2-lr1" in demo.stdout and "diverged" in demo.stdout
    assert (tmp_path / ".kb").is_dir()                   # the embedded default, in the folder it ran in
    [bash] = blocks("Try it after the demo", "bash")
    commands = [line.split("  #")[0] for line in bash.splitlines() if line.startswith("kb ")]
    assert len(commands) >= 6
    outputs = {}
    for cmd in commands:
        argv = shlex.split(cmd)
        proc = subprocess.run([KB, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr}"
        outputs[cmd] = proc.stdout
    assert commands[0].strip() == "kb demo --no-serve" and "added 0, updated 0, unchanged" in outputs[commands[0]]
    assert outputs[commands[1]].splitlines()[1].startswith("d1-lr1 ")     # status = 'diverged', by depth
    [python] = blocks("Try it after the demo", "python")
    proc = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
