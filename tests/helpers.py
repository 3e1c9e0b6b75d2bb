"""Shared test helpers: deterministic snapshot-like data and stub inspection."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, cast

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files
from kvchunkfs.format.index import Index
from kvchunkfs.store import stubs
from kvchunkfs.store.packs import PackStore


def rand_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def write_in_pieces(path: Path, data: bytes, piece: int, mode: str = "wb") -> None:
    with open(path, mode) as f:
        for i in range(0, len(data), piece):
            f.write(data[i : i + piece])


def write_content(content: FileContent, off: int, data: bytes) -> None:
    """What the FUSE write does, in this thread: a file of the content's own first, then write."""
    if not content.own_file():
        content.to_staging()
    content.write(off, data)


def truncate_content(content: FileContent, size: int) -> None:
    """What the FUSE truncate does, in this thread."""
    if not content.own_file():
        content.to_staging(size)
    content.truncate(size)


def prepare_commit(content: FileContent) -> tuple[Index, int]:
    """Store what the content holds: (index, generation). Blocking."""
    p = content.prepare()
    return p.index, p.gen


def save(files: Files, content: FileContent, rel: str, durable: bool = False) -> bool:
    """All of a save in one call, as the mount's close makes it (the caller owns the namespace)."""
    pending = files.prepare_save(content, rel, durable)
    saved = files.finish_save(pending, rel)
    if saved and pending.durable:
        files.sync_dir(rel)
    return saved


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unique_chunk_bytes(stub: Path) -> tuple[int, int]:
    """(distinct chunks, their total bytes) named by a stub."""
    index = stubs.read_index(stub)
    seen: dict[bytes, int] = {}
    for i, cid in enumerate(index.ids):
        seen[cid] = index.length(i)
    return len(seen), sum(seen.values())


def read_direct(path: Path) -> bytes:
    """Read around the kernel page cache (O_DIRECT), so the daemon's read path answers."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4 << 20)
    out = bytearray()
    try:
        while True:
            n = os.preadv(fd, [buf], len(out))
            out += buf[:n]
            if n < len(buf):
                return bytes(out)
    finally:
        os.close(fd)
        buf.close()


class HasLog(Protocol):
    def log(self) -> str: ...


def wait_for_log(m: HasLog, text: str, count: int, timeout: float = 30) -> None:
    """Until the daemon log holds ``count`` lines containing ``text``."""
    deadline = time.monotonic() + timeout
    while m.log().count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count}x {text!r} in the log:\n{m.log()[-3000:]}")
        time.sleep(0.02)


class HasStats(Protocol):
    def stats(self) -> dict[str, int]: ...


def wait_idle_checked(m: HasStats, checks_before: int, timeout: float = 30) -> None:
    """Until the daemon has looked at its heap after the current idle spell (it waits a moment with
    no file open, then trims if RSS is high: fuse/daemon.py, trim_when_idle)."""
    deadline = time.monotonic() + timeout
    while m.stats()["idle_checks"] <= checks_before:
        assert time.monotonic() < deadline, f"no memory trim: {m.stats()}"
        time.sleep(0.05)


def wait_closed(m: HasStats, timeout: float = 30) -> None:
    """Until the daemon has released every file: close() returns before FUSE's RELEASE arrives,
    and a file still open keeps its chunks pinned (so a GC right after close may keep them)."""
    deadline = time.monotonic() + timeout
    while m.stats()["open_files"]:
        assert time.monotonic() < deadline, f"files still open: {m.stats()}"
        time.sleep(0.02)


def loop_beside(step: Callable[[], None], work: Callable[[], None]) -> list[BaseException]:
    """Call ``step`` over and over on another thread while ``work`` runs here; what ``step`` raised
    (it stops at the first error)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - returned to the caller
                errors.append(e)
                return

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        work()
    finally:
        stop.set()
        thread.join()
    return errors


def stream_store(root: Path, sizes: list[int]) -> tuple[PackStore, Index, bytes]:
    """A store holding one random chunk of each size, back to back in one pack, and the index
    of a file made of them in order, with the file's bytes."""
    store = PackStore(root)
    chunks = []
    for n in sizes:
        data = os.urandom(n)
        chunks.append((hashlib.sha256(data).digest(), data))
    store.put_many(chunks, object())
    index = Index(1, 1 << 20, 4 << 20)
    for cid, data in chunks:
        index.append(cid, len(data))
    return store, index, b"".join(d for _, d in chunks)


def scatter_read(store: PackStore, index: Index, readers: int = 3) -> bytes:
    """The stored stream ``index`` names, read from ``store`` the way a put-back reads it
    (``Restore.scatter``: pieces on workers, each chunk checked) into a buffer."""
    from kvchunkfs.file.buffers import BufferPool
    from kvchunkfs.file.restore import Restore

    restore = Restore(cast(Any, SimpleNamespace(store=store)), BufferPool(64 << 20), 4)
    out = bytearray(index.size)

    def write(pos: int, piece: memoryview) -> None:
        out[pos : pos + len(piece)] = piece

    try:
        for _ in restore.scatter(index, write, None, readers):
            pass
    finally:
        restore.close()
    return bytes(out)
