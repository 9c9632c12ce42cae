"""The warm standby becomes the worker it is handed: environment, working folder, output, argv
and exit code as ``python script.py args`` would have them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_standby_runs_the_script_it_is_handed_as_a_fresh_interpreter_would(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "helper.py").write_text("VALUE = 'imported from beside the script'\n")
    (scripts / "job.py").write_text(
        "import os, sys\n"
        "import helper\n"
        "print('argv', sys.argv[1:], 'worker', os.environ['GPUHERD_ELASTIC_WORKER'], 'cwd', os.getcwd())\n"
        "print(helper.VALUE, 'main' if __name__ == '__main__' else __name__)\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(7)\n"
    )
    standby = subprocess.Popen([sys.executable, "-m", "gpuherd.train.standby"], stdin=subprocess.PIPE, cwd=tmp_path)
    log = tmp_path / "worker-3.log"
    launch = {
        "argv": [sys.executable, "scripts/job.py", "--steps", "5"],
        "env": {"GPUHERD_ELASTIC_WORKER": "n1/3", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"},
        "cwd": str(tmp_path),
        "log": str(log),
    }
    assert standby.stdin is not None
    standby.stdin.write((json.dumps(launch) + "\n").encode())
    standby.stdin.close()
    assert standby.wait(timeout=60) == 7
    lines = log.read_text().splitlines()
    assert lines[0] == f"argv ['--steps', '5'] worker n1/3 cwd {tmp_path}"
    assert lines[1] == "imported from beside the script main"
    assert "to stderr" in lines


def test_a_standby_that_is_never_needed_exits_quietly(tmp_path: Path) -> None:
    standby = subprocess.Popen([sys.executable, "-m", "gpuherd.train.standby"], stdin=subprocess.PIPE)
    assert standby.stdin is not None
    standby.stdin.close()
    assert standby.wait(timeout=60) == 0
