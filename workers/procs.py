"""Starting, watching and stopping stoker processes: the one helper `stoker up`, the benchmarks and the tests share."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: The source tree: children run from it, so `python -m stoker.cli` finds this checkout.
ROOT = Path(__file__).resolve().parent.parent


#: prctl(2) option: the signal a process gets when the thread that started it dies.
_PR_SET_PDEATHSIG = 1


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` after which the child gets `sig` when its parent dies, however it died (SIGKILL included).

    Linux's PR_SET_PDEATHSIG, through ctypes: the standard library has no wrapper (subprocess only offers
    `process_group`/`start_new_session`), and a child in its own session gets no SIGHUP from the terminal either.
    It fires when the *thread* that started the child ends, so start such children from the main thread. A parent
    that died before the child armed it is caught by comparing the parent's pid.
    """
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec must not import
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def spawn(args: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `stoker ARGS` in its own session (stopped as a group) with exactly this environment, output to log."""
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "stoker.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
    """Signal the process group, wait, and kill it if it lingers; returns the exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Poll check until it holds; fail early if one of procs died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: process exited early: {dead}")
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not ready after {timeout_s}s")


def tail(path: Path, lines: int = 40) -> str:
    """The end of a log, for failure messages."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each process group (workers finish their current task), then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
