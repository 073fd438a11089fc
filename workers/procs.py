"""Starting, watching and stopping stoker processes: the one helper `stoker up`, the benchmarks and the tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: The source tree: children run from it, so `python -m stoker.cli` finds this checkout.
ROOT = Path(__file__).resolve().parent.parent


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
