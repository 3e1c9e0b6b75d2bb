"""A read's reply spliced from a plain file (fuse/splicing.py), with a pipe standing in for
/dev/fuse: the reply is the header and the file's bytes, whole; whatever cannot be spliced sends
nothing and leaves the pipe empty, so the next reply (or the answer without the pipe) is right."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchunkfs.fuse import splicing
from kvchunkfs.fuse.splicing import PAGE, ReplyPipe, Unspliced

MiB = 1 << 20


@pytest.fixture
def pipe() -> Iterator[ReplyPipe]:
    p = ReplyPipe(MiB)
    yield p
    p.close()


@pytest.fixture
def dev() -> Iterator[tuple[int, int]]:
    """The reply's destination: a pipe big enough for any reply (read end, write end)."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    splicing.fcntl.fcntl(w, splicing.F_SETPIPE_SZ, MiB)
    yield r, w
    os.close(r)
    os.close(w)


@pytest.fixture
def shm_file() -> Iterator[tuple[int, bytes]]:
    """A plain file in memory (as the whole files are) and its bytes."""
    data = os.urandom(3 * PAGE + 123)
    fd = os.memfd_create("splice-test")
    os.write(fd, data)
    yield fd, data
    os.close(fd)


def _received(r: int) -> bytes:
    out = b""
    while True:
        try:
            out += os.read(r, MiB)
        except BlockingIOError:
            return out


def _pipe_empty(p: ReplyPipe) -> bool:
    try:
        os.read(p.r, 1)
    except BlockingIOError:
        return True
    return False


HEADER = struct.pack("<IiQ", 16, 0, 42)


def test_reply_is_header_and_range(pipe: ReplyPipe, dev: tuple[int, int], shm_file: tuple[int, bytes]) -> None:
    fd, data = shm_file
    for off, n in ((0, len(data)), (PAGE - 7, 2 * PAGE), (len(data) - 5, 5), (len(data), 0)):
        pipe.reply(dev[1], HEADER, fd, off, n)
        assert _received(dev[0]) == HEADER + data[off : off + n]
        assert _pipe_empty(pipe)


def test_largest_reply_fits(pipe: ReplyPipe, dev: tuple[int, int]) -> None:
    """The largest read the pipe takes is spliced whole from an unaligned offset too."""
    n = pipe.largest()
    assert pipe.fits(n) and not pipe.fits(n + 2 * PAGE)
    data = os.urandom(n + PAGE)
    fd = os.memfd_create("splice-test")
    try:
        os.write(fd, data)
        big_r, big_w = os.pipe2(os.O_NONBLOCK)
        try:
            splicing.fcntl.fcntl(big_w, splicing.F_SETPIPE_SZ, pipe.capacity * PAGE)
            pipe.reply(big_w, HEADER, fd, 100, n)
            assert _received(big_r) == HEADER + data[100 : 100 + n]
        finally:
            os.close(big_r)
            os.close(big_w)
    finally:
        os.close(fd)


def test_file_that_cannot_splice(
    pipe: ReplyPipe, dev: tuple[int, int], tmp_path: Path, shm_file: tuple[int, bytes]
) -> None:
    """A file its file system will not splice (a directory here): nothing sent, the pipe empty,
    and the failure lasting (the session stops trying)."""
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Unspliced) as e:
            pipe.reply(dev[1], HEADER, d, 0, 100)
        assert e.value.lasting
    finally:
        os.close(d)
    assert _received(dev[0]) == b"" and _pipe_empty(pipe)
    fd, data = shm_file
    pipe.reply(dev[1], HEADER, fd, 0, 10)  # the next reply is whole, nothing left over before it
    assert _received(dev[0]) == HEADER + data[:10]


def test_file_shorter_than_asked(pipe: ReplyPipe, dev: tuple[int, int], shm_file: tuple[int, bytes]) -> None:
    """The file ends before the range (truncated since its size was taken): nothing sent, not lasting."""
    fd, data = shm_file
    with pytest.raises(Unspliced) as e:
        pipe.reply(dev[1], HEADER, fd, len(data) - 10, 20)
    assert not e.value.lasting
    assert _received(dev[0]) == b"" and _pipe_empty(pipe)


def test_device_gone(pipe: ReplyPipe, shm_file: tuple[int, bytes]) -> None:
    """The destination refuses the reply: its error, and the pipe empty for the next one."""
    r, w = os.pipe2(os.O_NONBLOCK)
    os.close(r)  # a write end with no reader: EPIPE
    fd, _ = shm_file
    try:
        with pytest.raises(OSError) as e:
            pipe.reply(w, HEADER, fd, 0, 100)
        assert e.value.errno == errno.EPIPE
    finally:
        os.close(w)
    assert _pipe_empty(pipe)


def test_slots() -> None:
    assert splicing.pipe_slots_for(0) == 2
    assert splicing.pipe_slots_for(MiB) == MiB // PAGE + 2
