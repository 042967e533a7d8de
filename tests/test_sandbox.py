"""The sandbox against hostile programs: each attack fails inside its timeout, harmlessly.

Every test here runs real subprocesses. If the sandbox were broken, the "kill the parent"
attacks would end this pytest process; that the suite finishes is part of the check.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from cospec.errors import CoSpecError
from eval.sandbox import run_untrusted

TIMEOUT_S = 2.0
SLACK_S = 5.0  # interpreter start-up and the kill, on a loaded 2-core machine


def test_program_that_runs_to_the_end_passes() -> None:
    result = run_untrusted("import math\nprint(math.factorial(5))\nassert 1 + 1 == 2\n")
    assert result.passed, result.reason
    assert result.stdout == "120\n"
    assert result.returncode == 0
    assert result.reason == "passed"


@pytest.mark.parametrize(
    ("program", "reason_part"),
    [
        ("assert 1 == 2\n", "AssertionError"),
        ("def f(:\n", "SyntaxError"),
        ("raise SystemExit(3)\n", "exit status 3"),
        # Status 0 without reaching the end would skip the asserts that follow the code.
        ("import sys\nsys.exit(0)\nassert False\n", "before reaching the end"),
        ("import os\nos._exit(0)\nassert False\n", "before reaching the end"),
    ],
    ids=["assert", "syntax", "exit-3", "sys-exit-0", "os-exit-0"],
)
def test_failures_come_back_as_results(program: str, reason_part: str) -> None:
    result = run_untrusted(program)
    assert not result.passed
    assert reason_part in result.reason


HOSTILE = {
    "infinite-loop": "while True:\n    pass\n",
    "sleep-forever": "import time\ntime.sleep(3600)\n",
    "fork-bomb": "import os\nwhile True:\n    os.fork()\n",
    "spawn-bomb": (
        "import subprocess, sys\n"
        "while True:\n"
        "    subprocess.Popen([sys.executable, '-c', 'pass'])\n"
    ),
    "multiprocessing": (
        "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()\n"
    ),
    "shell": "import os\nos.system('sleep 60')\n",
    "huge-allocation": "block = bytearray(8 * 1024**3)\n",
    "huge-file": "f = open('big.bin', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n",
    "endless-output": "while True:\n    print('x' * 1000)\n",
    "kill-parent": "import os\nos.kill(os.getppid(), 9)\n",
    "kill-parent-group": "import os\nos.killpg(os.getpgid(os.getppid()), 9)\n",
    "kill-parent-pidfd": (
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)\n"
    ),
    "kill-parent-proc-fd": (
        "import os, signal\n"
        "fd = os.open('/proc/%d' % os.getppid(), os.O_RDONLY)\n"
        "signal.pidfd_send_signal(fd, 9)\n"
    ),
    "read-parent-environ": "import os\nprint(open('/proc/%d/environ' % os.getppid()).read())\n",
    "read-system-secret": "print(open('/etc/shadow').read())\n",
}


@pytest.mark.parametrize("program", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_program_fails_within_its_timeout(program: str) -> None:
    start = time.monotonic()
    result = run_untrusted(program, timeout_s=TIMEOUT_S)
    assert not result.passed
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert len(result.stdout) <= 2000 and len(result.stderr) <= 2000


def test_timeouts_and_limits_are_named() -> None:
    assert run_untrusted(HOSTILE["infinite-loop"], timeout_s=1).timed_out
    assert "MemoryError" in run_untrusted(HOSTILE["huge-allocation"]).reason
    assert "File too large" in run_untrusted(HOSTILE["huge-file"]).reason
    assert "fork() is disabled" in run_untrusted(HOSTILE["fork-bomb"]).reason


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A file outside the sandbox that hostile programs try to destroy."""
    path = tmp_path / "keep" / "sentinel.txt"
    path.parent.mkdir()
    path.write_text("precious")
    return path


ATTACKS_ON_SENTINEL = {
    "os.remove": "import os\nos.remove({path!r})\n",
    "pathlib.unlink": "import pathlib\npathlib.Path({path!r}).unlink()\n",
    "shutil.rmtree": "import os, shutil\nshutil.rmtree(os.path.dirname({path!r}))\n",
    "truncate-by-open": "open({path!r}, 'w').close()\n",
    "os.truncate": "import os\nos.truncate({path!r}, 0)\n",
    "os.rename": "import os\nos.rename({path!r}, 'stolen.txt')\n",
    "chdir-then-remove": (
        "import os\nos.chdir(os.path.dirname({path!r}))\nos.remove('sentinel.txt')\n"
    ),
    "symlink-then-write": "import os\nos.symlink({path!r}, 'link')\nopen('link', 'w').close()\n",
    "os.chmod": "import os\nos.chmod({path!r}, 0)\n",
    "shell-rm": "import os\nos.system('rm -f ' + {path!r})\n",
}


@pytest.mark.parametrize("attack", ATTACKS_ON_SENTINEL.values(), ids=ATTACKS_ON_SENTINEL.keys())
def test_files_outside_the_working_directory_survive(attack: str, sentinel: Path) -> None:
    mode = sentinel.stat().st_mode
    result = run_untrusted(attack.format(path=str(sentinel)), timeout_s=TIMEOUT_S)
    assert not result.passed
    assert sentinel.read_text() == "precious"
    assert sentinel.stat().st_mode == mode


def test_no_network() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port})).close()\n"
        result = run_untrusted(program, timeout_s=TIMEOUT_S)
    assert not result.passed
    assert "socket" in result.reason


def test_parent_environment_does_not_reach_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "cospec-test-secret-4f1e9a"
    monkeypatch.setenv("COSPEC_TEST_SECRET", secret)
    result = run_untrusted("import os\nprint(dict(os.environ))\n")
    assert result.passed, result.reason
    assert secret not in result.stdout
    assert "COSPEC_TEST_SECRET" not in result.stdout


def test_working_directory_is_fresh_usable_and_deleted() -> None:
    program = (
        "import os, tempfile\n"
        "print(os.getcwd())\n"
        "with open('scratch.txt', 'w') as f:\n"
        "    f.write('data')\n"
        "os.remove('scratch.txt')\n"
        "with tempfile.NamedTemporaryFile() as f:\n"
        "    f.write(b'data')\n"
        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
    )
    first, second = run_untrusted(program), run_untrusted(program)
    assert first.passed, first.reason
    assert second.passed, second.reason
    workdirs = {first.stdout.strip(), second.stdout.strip()}
    assert len(workdirs) == 2
    assert not any(Path(w).exists() for w in workdirs)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for its reaper counts as dead."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "zombie" not in state


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as non-root, RLIMIT_NPROC already stops the spawn itself"
)
def test_timeout_kills_processes_that_slipped_past_the_prelude() -> None:
    """The prelude is defence in depth; the process-group kill must hold when it is undone."""
    program = (
        "import sys, time\n"
        "del sys.modules['subprocess'], sys.modules['_posixsubprocess']\n"
        "import subprocess\n"
        "print(subprocess.Popen(['sleep', '600']).pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    result = run_untrusted(program, timeout_s=TIMEOUT_S)
    assert result.timed_out
    grandchild = int(result.stdout.split()[0])
    deadline = time.monotonic() + SLACK_S  # SIGKILL is delivered asynchronously
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_invalid_limits_are_user_errors() -> None:
    with pytest.raises(CoSpecError, match="timeout_s=0"):
        run_untrusted("pass", timeout_s=0)
