"""A stop (SIGTERM or SIGINT: what ``systemctl stop`` and ``restart`` and a Ctrl-C send) never breaks
a save in flight: the mount keeps serving until the files open for writing are closed and saved
(bounded by ``stop_timeout``), refusing new writes meanwhile; past the bound the writer loses its
unsaved writes and the file keeps its previous version."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes, wait_for_log

MiB = 1 << 20
SIZE = 48 * MiB  # a save of llama-server's order, written as it writes: 1 MiB at a time
PIECES = SIZE // MiB
# Where each round's writer sends the signal: before its first write (0), after n writes, after the
# last write before close (PIECES), and after the close before the rename (PIECES + 1).
POINTS = [0, 1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 46, 47, PIECES, PIECES + 1, PIECES, PIECES + 1]
STOPPING = "stopping: new writes refused"


@pytest.fixture
def cpu_hog_beside() -> Iterator[None]:
    """A process that keeps a core busy: the stop must not depend on the daemon being quick."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def round_data(base: bytes, n: int) -> bytes:
    """``base`` with each MiB's first bytes made the round's own: every save differs in every piece."""
    out = bytearray(base)
    for i in range(PIECES):
        out[i * MiB : i * MiB + 16] = n.to_bytes(8, "little") + i.to_bytes(8, "little")
    return bytes(out)


def llama_save(mnt: Path, name: str, data: bytes, at: int, point: Callable[[], None]) -> None:
    """Save as llama-server and the proxy do: ``NAME.tmp`` written 1 MiB at a time, closed, renamed
    over ``NAME``; ``point`` is called after ``at`` writes (see POINTS)."""
    tmp = mnt / f"{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(PIECES):
            if i == at:
                point()
            view = memoryview(data)[i * MiB : (i + 1) * MiB]
            while view:
                view = view[os.write(fd, view) :]
        if at == PIECES:
            point()
    finally:
        os.close(fd)
    if at == PIECES + 1:
        point()
    os.rename(tmp, mnt / name)


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_a_signal_lets_the_save_in_flight_finish(tmp_path: Path, cpu_hog_beside: None) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--stop-timeout", "60"])
    base = rand_bytes(SIZE, 7)
    saved: dict[str, str] = {}
    m.start()
    try:
        for n, at in enumerate(POINTS):
            assert m.proc is not None
            pid, signum = m.proc.pid, signal.SIGINT if n % 4 == 3 else signal.SIGTERM
            data = round_data(base, n)
            name = f"slot-{n % 3}.bin"  # later rounds replace earlier saves too
            llama_save(m.mnt, name, data, at, lambda: os.kill(pid, signum))  # noqa: B023 - called in this round
            saved[name] = hashlib.sha256(data).hexdigest()
            assert m.wait_exit() == 0
            m.start()  # the next mount shows each save whole
            names = sorted(os.listdir(m.mnt))
            assert names == sorted(saved), f"round {n} (signal after {at} writes): {names}"
            for other, want in saved.items():
                assert digest(m.path(other)) == want, f"round {n} (signal after {at} writes): {other} is not whole"
        # A signal after the close may still find the handle's release in flight (it follows the
        # close, which no longer waits for the save to be stored): then it waits for it too.
        assert len(POINTS) - POINTS.count(PIECES + 1) <= m.log().count(STOPPING) <= len(POINTS)
    finally:
        m.stop()


def test_past_the_bound_the_previous_version_stays(tmp_path: Path) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--stop-timeout", "5"])
    first, other = rand_bytes(4 * MiB, 1), rand_bytes(2 * MiB, 2)
    m.start()
    fds: list[int] = []
    try:
        m.path("held").write_bytes(first)
        m.path("other").write_bytes(other)
        held = os.open(m.path("held"), os.O_WRONLY | os.O_TRUNC)  # a writer that never closes
        fresh = os.open(m.path("fresh.tmp"), os.O_WRONLY | os.O_CREAT, 0o644)  # a new file, never closed
        fds += [held, fresh]
        os.write(held, rand_bytes(MiB, 3))
        os.write(fresh, rand_bytes(MiB, 4))
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        wait_for_log(m, STOPPING, 1)
        # Waiting for the writers: new writes are refused, everything else is served.
        with pytest.raises(OSError) as refused:
            os.open(m.path("new"), os.O_WRONLY | os.O_CREAT, 0o644)
        assert refused.value.errno == errno.EROFS
        with pytest.raises(OSError) as refused:
            os.open(m.path("other"), os.O_WRONLY)
        assert refused.value.errno == errno.EROFS
        assert m.path("other").read_bytes() == other
        assert m.wait_exit(timeout=30) == 0  # the bound ends the wait
        log = m.log()
        assert "2 file(s) still open for writing: fresh.tmp, held" in log, log[-3000:]
        # Unmounted: the writer's unsaved bytes are not taken. Served, its write fails; passed
        # through, the kernel may still write its (orphaned) staged file, which no stub names.
        with contextlib.suppress(OSError):
            os.write(held, b"late")
        m.start()
        assert m.path("held").read_bytes() == first  # the previous version, whole
        assert m.path("other").read_bytes() == other
        assert m.path("fresh.tmp").read_bytes() == b""  # created, never saved: empty, not a prefix
        assert not m.path("new").exists()
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        m.stop()


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--stop-timeout", "3600"])
    first = rand_bytes(2 * MiB, 5)
    m.start()
    fd = -1
    try:
        m.path("held").write_bytes(first)
        fd = os.open(m.path("held"), os.O_WRONLY)
        os.write(fd, b"unsaved")
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        wait_for_log(m, STOPPING, 1)
        assert m.proc.poll() is None  # waiting for the writer
        assert m.signal_stop(signal.SIGINT, timeout=30) == 0  # not the hour of the bound
        assert "again: unmounting now" in m.log()
        m.start()
        assert m.path("held").read_bytes() == first
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        m.stop()
