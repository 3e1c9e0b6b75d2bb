"""A kv-chunk-fs mount run as a child process (or a plain directory standing in for it)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATS_XATTR = "user.kvcfs.stats"


def default_mount_cmd() -> list[str]:
    """``python -m kvchunkfs.cli`` with this checkout's src first on the path (an installed
    ``kv-chunk-fs`` may belong to another checkout); ``$KVCFS_MOUNT_CMD`` overrides it."""
    env_cmd = os.environ.get("KVCFS_MOUNT_CMD")
    if env_cmd:
        return shlex.split(env_cmd)
    return [sys.executable, "-m", "kvchunkfs.cli"]


def dir_bytes(d: Path) -> int:
    """Total size of the regular files under ``d`` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


class Mount:
    """``kv-chunk-fs mount --store STORE MNT`` in the foreground of a child process.

    With ``plain=True`` there is no filesystem: ``mnt`` is an ordinary directory (used to develop
    the llama-server side before the CLI existed, and as a control run).
    """

    def __init__(
        self,
        store: Path,
        mnt: Path,
        log: Path,
        *,
        plain: bool = False,
        cmd: list[str] | None = None,
        extra_args: list[str] | None = None,
    ):
        self.store = Path(store)
        self.mnt = Path(mnt)
        self.log = Path(log)
        self.plain = plain
        self.cmd = cmd or default_mount_cmd()
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self._logf = None

    # -- bytes-new counter ------------------------------------------------------------------
    def stored_bytes(self) -> int | None:
        """Size of the store's packs (the "bytes new" counter is its growth). None when plain."""
        if self.plain:
            return None
        return dir_bytes(self.store / "packs")

    def counters(self) -> dict | None:
        """The filesystem's own counters (xattr ``user.kvcfs.stats`` on the root), if it has them."""
        if self.plain:
            return None
        try:
            return json.loads(os.getxattr(self.mnt, STATS_XATTR))
        except (OSError, ValueError):
            return None

    def ingested(self, timeout: float = 600.0) -> None:
        """Wait until every closed save is stored as chunks (the daemon stores them behind the
        close: the packs' growth is a save's new bytes only once it is)."""
        deadline = time.monotonic() + timeout
        while (self.counters() or {}).get("ingest_queue", 0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"saves not stored after {timeout} s")
            time.sleep(0.05)

    def store_bytes_total(self) -> int | None:
        if self.plain:
            return None
        return dir_bytes(self.store)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        if self.plain:
            return
        if os.path.ismount(self.mnt):
            raise RuntimeError(f"{self.mnt} is already a mount point")
        env = dict(os.environ)
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [*self.cmd, "mount", "--store", str(self.store), *self.extra_args, str(self.mnt)]
        self._logf = open(self.log, "ab")
        self._logf.write(f"\n=== {time.strftime('%H:%M:%S')} {shlex.join(argv)}\n".encode())
        self._logf.flush()
        self.proc = subprocess.Popen(
            argv, stdout=self._logf, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode}; see {self.log}")
            if os.path.ismount(self.mnt):
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.mnt} not mounted after {timeout}s; see {self.log}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """Unmount with ``fusermount3 -u`` and wait for the process to exit (bounded)."""
        if self.plain or self.proc is None:
            return None
        rc = None
        deadline = time.monotonic() + timeout
        if os.path.ismount(self.mnt):
            for _ in range(20):
                r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, timeout=30)
                if r.returncode == 0 or not os.path.ismount(self.mnt):
                    break
                time.sleep(0.25)  # EBUSY: a file may still be open for a moment
        try:
            rc = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                rc = self.proc.wait(timeout=15)
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True, timeout=30)
        self.proc = None
        if self._logf:
            self._logf.close()
            self._logf = None
        return rc

    def remount(self) -> None:
        self.stop()
        self.start()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
