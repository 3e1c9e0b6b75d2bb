"""Fixtures that mount the real filesystem through FUSE in a separate daemon process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
TESTS = Path(__file__).resolve().parent
# KVCFS_TEST_BUSY=1: every daemon runs with its saves' storing slowed and sped at random
# (tests/jitter_daemon.py) and a process keeps one core busy for the whole session.
BUSY = os.environ.get("KVCFS_TEST_BUSY") == "1"
MOUNTED = "kvchunkfs.fuse.daemon: mounted "  # the daemon's log line once it serves
CATALOG_LOADED = "kvchunkfs.service.live: catalog: "  # ... once its snapshot catalog is read

# Test tiers (pytest markers, see pyproject.toml). Modules here need neither root nor FUSE; every other
# module mounts the real filesystem and is marked `fuse`; `remote` and `browser` mark the tests that
# also start SeaweedFS or Chromium, `slow` the exhaustive unit tests (minutes).
UNIT_MODULES = {
    "test_backing_turns",
    "test_buffers",
    "test_cli_help",
    "test_config",
    "test_docs",
    "test_evict_units",
    "test_file_record",
    "test_fuzz_relayout",
    "test_format_cutter",
    "test_format_stream",
    "test_chunking_windows",
    "test_fuse_protocol",
    "test_formula",
    "test_gc_changes",
    "test_idarrays",
    "test_ingest_memory",
    "test_layers",
    "test_memtier_units",
    "test_ops_inprocess",
    "test_pack_store_units",
    "test_prefix_match",
    "test_prefixtree",
    "test_putback",
    "test_sparse_copy",
    "test_splicing",
    "test_units",
}
EXTRA_MARKS = {"test_remote": "remote", "test_ui": "browser", "test_chunking_windows": "slow"}


def fuse_missing() -> str | None:
    """Why real mounts cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "real-mount tests need root (allow_other, dropping caches, other users)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = fuse_missing()
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in EXTRA_MARKS:
            item.add_marker(getattr(pytest.mark, EXTRA_MARKS[module]))
        if module in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)
            continue
        item.add_marker(pytest.mark.fuse)
        if missing:
            item.add_marker(pytest.mark.skip(reason=missing))


def is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


class Mount:
    """A kv-chunk-fs daemon serving ``store`` on ``mnt``; restartable."""

    def __init__(self, store: Path, mnt: Path, log: Path, extra: list[str] | None = None, jitter: bool = BUSY) -> None:
        self.store, self.mnt, self.log_path = store, mnt, log
        self.extra = extra or []
        self.jitter = jitter
        self.proc: subprocess.Popen[bytes] | None = None
        self.preexec: Callable[[], None] | None = None  # run in the daemon's process before it starts
        self._catalogs_before = 0
        mnt.mkdir(parents=True, exist_ok=True)
        # Staged saves and hot copies: in memory as by default, one directory per test's store,
        # all removed at the end of the session (``whole_files_root``).
        WHOLE_ROOT.mkdir(mode=0o700, exist_ok=True)
        self.whole = WHOLE_ROOT / uuid.uuid4().hex

    def start(self, extra: list[str] | None = None) -> None:
        if extra is not None:
            self.extra = extra
        mounts_before = self.log().count(MOUNTED)
        self._catalogs_before = self.log().count(CATALOG_LOADED)
        env = dict(os.environ, PYTHONPATH=str(SRC))
        launcher = [str(TESTS / "jitter_daemon.py")] if self.jitter else ["-m", "kvchunkfs.cli"]
        # A stop keeps the memory tier (hot copies survive a restart), and a mount on an emptied tier
        # puts nothing back before a client asks (no warm-up: tests/test_warmup.py turns it on),
        # unless a test sets them otherwise.
        cmd = [sys.executable, *launcher, "mount", "--store", str(self.store), "--whole-files-dir", str(self.whole),
               "--memory-tier-on-stop", "keep", "--warm-up", "0", *self.extra, str(self.mnt)]  # fmt: skip
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=self.preexec)
        deadline = time.monotonic() + 30
        # After a kill -9 the dead mount is still listed, so wait for this daemon's own "mounted".
        while not (is_mounted(self.mnt) and self.log().count(MOUNTED) > mounts_before):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mount did not appear: {self.log()}")
            time.sleep(0.05)

    def start_settled(self, extra: list[str] | None = None) -> None:
        """Start (after a kill too) and wait for recovery and the GC every mount begins with."""
        gcs = self.log().count("gc finished")
        self.start(extra)
        deadline = time.monotonic() + 30
        while self.log().count("gc finished") <= gcs:
            assert time.monotonic() < deadline, f"no GC after mount: {self.log()[-3000:]}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, capture_output=True)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self._log.close()
        self.proc = None
        assert not is_mounted(self.mnt), "mount left behind"

    def signal_stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Stop the daemon as systemd does (a signal), wait for it to exit; its exit status."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 60) -> int:
        """Wait for a daemon that was told to stop; its exit status. The mount must be gone."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # leave nothing behind; the test fails
            self.proc.wait(timeout=30)
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, capture_output=True)
            rc = None
        self._log.close()
        self.proc = None
        assert rc is not None, f"daemon did not exit within {timeout} s: {self.log()[-3000:]}"
        assert not is_mounted(self.mnt), "mount left behind"
        return rc

    def kill(self) -> None:
        """kill -9 the daemon (a crash), leaving the dead mount for the next start to clear."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()
        self.proc = None

    def remount(self, extra: list[str] | None = None) -> None:
        self.stop()
        self.start(extra)

    def catalog_loaded(self, timeout: float = 30) -> None:
        """Wait until this daemon's snapshot catalog has been read. Loading it reads the first
        chunks of every snapshot (their token prefixes) from the packs, so a test that counts pack
        reads waits for it first, or the count depends on when the load thread ran."""
        deadline = time.monotonic() + timeout
        while self.log().count(CATALOG_LOADED) <= self._catalogs_before:
            assert time.monotonic() < deadline, f"no catalog load after mount: {self.log()[-3000:]}"
            time.sleep(0.02)

    def stats(self) -> dict[str, int]:
        return json.loads(os.getxattr(self.mnt, "user.kvcfs.stats"))

    def ingested(self, timeout: float = 60) -> None:
        """Wait until every closed save is stored as chunks (ingestion runs behind the close)."""
        deadline = time.monotonic() + timeout
        while self.stats().get("ingest_queue", 0):
            assert time.monotonic() < deadline, f"saves not stored after {timeout} s: {self.log()[-3000:]}"
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def path(self, name: str) -> Path:
        return self.mnt / name


WHOLE_ROOT = Path("/dev/shm") / f"kvcfs-tests-{os.getpid()}"


def remove_whole_files(path: Path) -> None:
    """Delete a whole-file directory, the daemon's own tmpfs mounts in it (huge pages) detached first."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p == real or p.startswith(real + "/")), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def whole_files_root() -> Iterator[None]:
    """The tests' whole-file directories go with the session."""
    yield
    remove_whole_files(WHOLE_ROOT)


@pytest.fixture(scope="session", autouse=True)
def cpu_hog() -> Iterator[None]:
    """In busy mode, one core stays busy for the whole session (bugs that hide on an idle machine)."""
    if not BUSY:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


@pytest.fixture
def kvfs(tmp_path: Path) -> Iterator[Mount]:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    m.start()
    try:
        yield m
    finally:
        m.stop()
        remove_whole_files(m.whole)


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    d = tmp_path / "plain"
    d.mkdir()
    return d
