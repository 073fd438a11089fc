"""vLLM's own renderer as a peer on this host: `vllm launch render MODEL_DIR` on the CPU, bound to 127.0.0.1, usage
statistics off and the hub offline; the one launcher the recording of vLLM's renders (`make peer`) and the render
benchmark (`bench.render`) share.

Only the standard library: the recording script imports it in vLLM's own venv, where stoker is not installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

#: vLLM's settings for a peer on this host: the CPU platform, no usage reports, no hub.
ENVIRONMENT = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
#: Where `make peer` installs vLLM (`PEER_VENV`): a venv of its own, never the project's.
PEER_VENV = Path("~/.cache/stoker/vllm-venv").expanduser()
STARTUP_S = 300.0


@contextlib.contextmanager
def render_server(model_dir: Path, port: int, log: Path, vllm: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`vllm launch render` for the model on 127.0.0.1:port, its log in `log`, until it answers /health; stopped
    (its whole session) on exit. `vllm`: the command, by default the one beside this Python (vLLM's venv)."""
    command = [str(vllm or Path(sys.executable).parent / "vllm"), "launch", "render", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    # The name stoker serves a model directory as; tool calls parsed as stoker reads them (Hermes' convention).
    command += ["--served-model-name", model_dir.name, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env={**os.environ, **ENVIRONMENT}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", process)
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_healthy(base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm launch render exited with {process.returncode}: see its log")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/health", timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"vllm launch render did not answer within {STARTUP_S:.0f} s")
