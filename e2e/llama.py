"""A llama-server child process on a free loopback port, and a tiny JSON client (stdlib only)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class LlamaServer:
    def __init__(
        self,
        binary: Path,
        model: Path,
        slot_dir: Path,
        log: Path,
        *,
        ctx: int = 4096,
        threads: int = 2,
        flash_attn: str = "on",
        extra: list[str] | None = None,
    ):
        self.binary = Path(binary)
        self.model = Path(model)
        self.slot_dir = Path(slot_dir)
        self.log = Path(log)
        self.ctx = ctx
        self.threads = threads
        self.flash_attn = flash_attn
        self.extra = extra or []
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._logf = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def argv(self, port: int) -> list[str]:
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(port),
            "-c",
            str(self.ctx),
            "-np",
            "1",
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-fa",
            self.flash_attn,
            "--slot-save-path",
            str(self.slot_dir),
            "--no-webui",
            "--no-warmup",
            "--cache-ram",
            "0",  # no host-RAM prompt cache: only slot files carry state
            *self.extra,
        ]

    def start(self, timeout: float = 180.0) -> None:
        last_err = None
        for _attempt in range(3):  # the free port can be taken between probe and bind
            port = free_port()
            argv = self.argv(port)
            self._logf = open(self.log, "ab")
            self._logf.write(f"\n=== {time.strftime('%H:%M:%S')} {shlex.join(argv)}\n".encode())
            self._logf.flush()
            self.proc = subprocess.Popen(
                argv, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
            self.port = port
            try:
                self._wait_healthy(timeout)
                return
            except ServerError as e:
                last_err = e
                self.stop()
        raise ServerError(f"llama-server did not start: {last_err}; see {self.log}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise ServerError(f"not healthy after {timeout}s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=timeout)
            self.proc = None
        if self._logf:
            self._logf.close()
            self._logf = None

    # -- HTTP -----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {path}: HTTP {e.code}: {e.read()[:2000]!r}") from None

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        r = self.request("POST", "/tokenize", {"content": text, "add_special": add_special})
        return [t if isinstance(t, int) else t["id"] for t in r["tokens"]]

    def complete(self, prompt: list[int], n_predict: int, seed: int = 1) -> dict:
        return self.request(
            "POST",
            "/completion",
            {
                "prompt": prompt,
                "n_predict": n_predict,
                "cache_prompt": True,
                "id_slot": 0,
                "temperature": 0.0,
                "top_k": 1,
                "seed": seed,
                "ignore_eos": True,
                "return_tokens": True,
                "stream": False,
            },
        )

    def slot_action(self, action: str, filename: str) -> dict:
        return self.request("POST", f"/slots/0?action={action}", {"filename": filename})

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
