"""Run untrusted generated code in a separate, resource-limited Python process.

HumanEval and MBPP are graded by executing model output, and model output is untrusted: it
may loop forever, fork, allocate without bound, fill the disk, delete files, read secrets or
signal the evaluator. The layers, outermost first:

1. a fresh ``python -I -S`` process (isolated mode, no site hooks, so only the standard
   library is importable: the benchmarks need nothing else) in a fresh temporary working
   directory that is deleted afterwards, with stdin closed and an environment that holds
   only ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR`` (the last two point at that directory),
   so no secret in the parent's environment reaches the child;
2. ``resource`` limits (CPU seconds, address space, file size, process count, no core
   dumps) set between fork and exec, before the interpreter starts;
3. its own session and process group, killed as a whole with SIGKILL at the wall-clock
   timeout, so nothing it started survives the run;
4. a prelude, run inside the child before the program, that disables process creation,
   signalling other processes, writes outside the working directory and reads outside an
   allowlist (the idea of OpenAI human-eval's ``reliability_guard``).

Layer 4 is defence in depth, not a boundary: a determined program can undo it (for
example by deleting the blocked entries from ``sys.modules``). And a process running as
root ignores ``RLIMIT_NPROC`` and can raise its own limits. Layers 1-3 keep a run from
hanging the evaluator or leaving processes behind whatever the program does; on a shared
machine, also run the evaluation as an unprivileged user or inside a container.

Linux only (``os.pidfd_open``, ``/proc``).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cospec.errors import CoSpecError

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_MAX_FILE_MB = 16
DEFAULT_TAIL_CHARS = 2000

# Runs as ``python -I -S -c _PRELUDE program.py MARKER`` in the working directory. It reads
# the program, disables the dangerous parts of the standard library, runs the program as
# ``__main__`` and, only if the program ran to its end, writes MARKER to stdout. The marker
# is what tells "ran to the end" apart from an early ``sys.exit(0)`` / ``os._exit(0)``,
# which would otherwise skip the asserts that follow and still exit with status 0.
_PRELUDE = r"""
import _signal, builtins, io, os, posix, signal, sys


def _run():
    path, marker = sys.argv[1], sys.argv[2]
    del sys.argv[1:]
    with open(path, encoding="utf-8") as f:
        source = f.read()
    root = os.path.realpath(os.getcwd())
    read_roots = {root, "/proc/%d" % os.getpid(), "/usr"} | {
        os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)
    }
    devices = {"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"}

    def resolve(target, dir_fd=None):
        # The directory part is resolved, the last component is not: unlinking a symlink
        # touches the link itself, not what it points to.
        base = os.getcwd() if dir_fd is None else os.readlink("/proc/self/fd/%d" % dir_fd)
        head, tail = os.path.split(os.path.normpath(os.path.join(base, os.fsdecode(target))))
        return os.path.join(os.path.realpath(head), tail)

    def under(real, roots):
        return any(real == r or real.startswith(r + os.sep) for r in roots)

    def may_write(target, dir_fd=None):
        if isinstance(target, int):
            return True
        real = resolve(target, dir_fd)
        return real in devices or under(real, (root,))

    def may_read(target, dir_fd=None):
        if isinstance(target, int):
            return True
        real = os.path.realpath(resolve(target, dir_fd))
        return real in devices or under(real, read_roots)

    def refuse(what, target):
        raise PermissionError("CoSpec sandbox: %s %r is not allowed" % (what, target))

    def disabled(name):
        def call(*args, **kwargs):
            raise PermissionError("CoSpec sandbox: %s() is disabled" % name)
        return call

    def guarded_path_call(name, func):
        def call(*args, **kwargs):
            if "src_dir_fd" in kwargs or "dst_dir_fd" in kwargs:
                refuse(name + " with src_dir_fd/dst_dir_fd", args)
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    if not may_write(arg, kwargs.get("dir_fd")):
                        refuse(name, arg)
            return func(*args, **kwargs)
        return call

    real_open = io.open

    def guarded_open(file, mode="r", *args, **kwargs):
        writing = any(c in mode for c in "wax+")
        if not (may_write(file) if writing else may_read(file)):
            refuse("open(mode=%r)" % mode, file)
        return real_open(file, mode, *args, **kwargs)

    real_os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_os_open(file, flags, *args, **kwargs):
        check = may_write if flags & write_flags else may_read
        if not check(file, kwargs.get("dir_fd")):
            refuse("os.open", file)
        return real_os_open(file, flags, *args, **kwargs)

    builtins.open = io.open = guarded_open
    for module in (os, posix):
        module.open = guarded_os_open
        for name in ("remove", "unlink", "rmdir", "rename", "replace", "truncate", "chmod",
                     "chown", "lchown", "link", "symlink", "mkdir", "mkfifo", "mknod",
                     "utime"):
            if hasattr(module, name):
                setattr(module, name, guarded_path_call(name, getattr(module, name)))
        for name in dir(module):
            if name.startswith(("exec", "spawn", "fork", "posix_spawn", "kill", "pidfd")) or (
                name in ("system", "popen", "fchmod", "fchown", "chroot", "setsid",
                         "setpgid", "setpgrp", "setuid", "setgid")
            ):
                setattr(module, name, disabled(name))
    signal.pidfd_send_signal = _signal.pidfd_send_signal = disabled("pidfd_send_signal")
    for name in ("subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing",
                 "ctypes", "_ctypes", "resource", "pty", "socket", "_socket"):
        sys.modules[name] = None

    code = compile(source, path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": builtins})
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, marker.encode())


_run()
"""


@dataclass(frozen=True)
class ExecutionResult:
    """What happened to one untrusted program; a failure of any kind is ``passed=False``.

    ``stdout`` and ``stderr`` are the tails of the streams; ``reason`` is one line for
    reports (``"passed"``, ``"timed out after 10 s"``, ``"exit status 1: AssertionError"``).
    """

    passed: bool
    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    reason: str
    wall_s: float


def run_untrusted(
    program: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_file_mb: int = DEFAULT_MAX_FILE_MB,
    tail_chars: int = DEFAULT_TAIL_CHARS,
) -> ExecutionResult:
    """Run ``program`` in the sandbox; it passes when it runs to its end with status 0.

    Never raises because of what the program does: crashes, timeouts and limits come back
    as a failed result whose ``reason`` says why. Output is written to unlinked temporary
    files (bounded by the file-size limit) rather than pipes, so a program that prints
    without end cannot grow the evaluator's memory, and only the last ``tail_chars`` of
    each stream are kept. Safe to call from several threads at once.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_file_mb <= 0:
        raise CoSpecError(
            f"sandbox limits must be positive (timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_file_mb={max_file_mb})"
        )
    marker = secrets.token_hex(16)
    with (
        tempfile.TemporaryDirectory(prefix="cospec-sandbox-") as workdir,
        tempfile.TemporaryFile() as stdout_file,
        tempfile.TemporaryFile() as stderr_file,
    ):
        program_path = Path(workdir) / "program.py"
        program_path.write_bytes(program.encode("utf-8", errors="replace"))
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PRELUDE, str(program_path), marker],
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir},
            stdin=subprocess.DEVNULL,
            stdout=stdout_file,
            stderr=stderr_file,
            start_new_session=True,
            preexec_fn=_resource_limiter(timeout_s, memory_mb, max_file_mb),
        )
        try:
            timed_out = not _wait_for_exit(proc.pid, timeout_s)
        finally:
            # Also on an interrupt. The leader has exited (or timed out) but is not reaped
            # yet, so its process group id cannot have been reused: this cannot hit a stranger.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        wall_s = time.monotonic() - start
        stdout = _tail(stdout_file, tail_chars + len(marker))
        stderr = _tail(stderr_file, tail_chars)
    finished = stdout.endswith(marker)
    stdout = stdout.removesuffix(marker)[-tail_chars:]
    passed = not timed_out and returncode == 0 and finished
    return ExecutionResult(
        passed=passed,
        returncode=returncode,
        timed_out=timed_out,
        stdout=stdout,
        stderr=stderr,
        reason=_reason(passed, timed_out, timeout_s, returncode, stderr),
        wall_s=wall_s,
    )


def _resource_limiter(timeout_s: float, memory_mb: int, max_file_mb: int) -> Callable[[], None]:
    """The ``preexec_fn``: limits apply from before the interpreter starts.

    Soft and hard limits are equal so an unprivileged program cannot raise them (capped at
    the evaluator's own hard limits, which it could not raise either). The CPU
    limit sits above the wall-clock timeout: it only matters if the evaluator stalls.
    ``RLIMIT_NPROC=1`` stops an unprivileged child creating processes or threads (the count
    is per user, so any small value means "none"); root ignores it, hence the prelude and
    the group kill. The function only calls ``setrlimit`` on an already-imported module,
    which is what keeps ``preexec_fn`` safe while other threads run sandboxes.
    """
    wanted = {
        resource.RLIMIT_CPU: math.ceil(timeout_s) + 1,
        resource.RLIMIT_AS: memory_mb * 1024 * 1024,
        resource.RLIMIT_FSIZE: max_file_mb * 1024 * 1024,
        resource.RLIMIT_NPROC: 1,
        resource.RLIMIT_CORE: 0,
    }
    limits = []
    for limit, value in wanted.items():
        hard = resource.getrlimit(limit)[1]
        capped = value if hard == resource.RLIM_INFINITY else min(value, hard)
        limits.append((limit, capped))

    def apply() -> None:
        for limit, value in limits:
            resource.setrlimit(limit, (value, value))

    return apply


def _wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` exits, without reaping it; False if ``timeout_s`` passed first.

    A pidfd becomes readable when the process exits, which wakes us at once (no polling
    delay per program) and leaves the zombie in place for the group kill.
    """
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()  # not select.select: that fails for descriptors >= 1024
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)


def _tail(file: IO[bytes], max_chars: int) -> str:
    """The last ``max_chars`` characters of a stream the child wrote (UTF-8, lossy)."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(max(0, size - 4 * max_chars))
    return file.read().decode("utf-8", errors="replace")[-max_chars:]


_SIGNAL_CAUSES = {
    signal.SIGXCPU: "CPU time limit",
    signal.SIGXFSZ: "file size limit",
    signal.SIGKILL: "killed",
    signal.SIGSEGV: "crash",
}


def _reason(passed: bool, timed_out: bool, timeout_s: float, returncode: int, stderr: str) -> str:
    """One line for reports: why the program failed (or ``"passed"``)."""
    if passed:
        return "passed"
    if timed_out:
        return f"timed out after {timeout_s:g} s"
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:  # real-time signals have no name
            return f"killed by signal {-returncode}"
        cause = _SIGNAL_CAUSES.get(sig)
        return f"{sig.name} ({cause})" if cause else sig.name
    if returncode == 0:
        return "exited with status 0 before reaching the end of the program"
    last_line = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"exit status {returncode}: {last_line.strip()}"
