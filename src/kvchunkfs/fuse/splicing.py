"""A read's reply spliced from a plain file: the kernel copies the bytes, once, from the file's pages
into the reply; they never cross into the daemon.

The reply's header is written into a pipe, the file's range spliced after it (tmpfs hands the pipe
references to its pages, no copy), then the pipe is spliced to ``/dev/fuse`` as one reply (the
kernel takes a reply whole from a pipe, or none of it). Against ``pread`` + ``writev`` this saves a
copy of the bytes and the allocation of a buffer for them.

Every step is non-blocking and the pipe is empty between replies. Whatever goes wrong before the
reply is sent (a file system that cannot splice, a short splice, a pipe the kernel will not make
big enough) drains the pipe and says so: the caller then answers as it would have without a pipe.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
_NONBLOCK = os.SPLICE_F_NONBLOCK
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Unspliced(Exception):
    """Nothing was sent: answer without the pipe. ``lasting``: it will fail again (stop trying)."""

    def __init__(self, why: str, lasting: bool) -> None:
        super().__init__(why)
        self.lasting = lasting


def pipe_slots_for(size: int) -> int:
    """Pipe buffers a reply of ``size`` bytes from any offset takes: the header's, one per page of
    the range, one more where the range does not start on a page."""
    return 1 + (size + PAGE - 1) // PAGE + 1


def _pipe_max_size() -> int:
    with open("/proc/sys/fs/pipe-max-size") as f:
        return int(f.read())


class ReplyPipe:
    """One pipe for the replies of a session's thread (each reply goes through it whole, without
    yielding, so one is enough)."""

    def __init__(self, largest: int) -> None:
        """A pipe holding a reply of ``largest`` bytes (OSError if the kernel refuses the size:
        above ``/proc/sys/fs/pipe-max-size`` without CAP_SYS_RESOURCE)."""
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        want = 1 << (pipe_slots_for(largest) * PAGE - 1).bit_length()  # the kernel's slots: a power of 2
        try:
            try:
                size = fcntl.fcntl(self.w, F_SETPIPE_SZ, want)
            except PermissionError:  # above pipe-max-size without CAP_SYS_RESOURCE: the most allowed
                size = fcntl.fcntl(self.w, F_SETPIPE_SZ, _pipe_max_size())
        except OSError:
            self.close()
            raise
        self.capacity = size // PAGE

    def close(self) -> None:
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1

    def largest(self) -> int:
        """The largest read whose reply fits, page-aligned as the kernel's reads are."""
        return (self.capacity - 2) * PAGE

    def fits(self, size: int) -> bool:
        return pipe_slots_for(size) <= self.capacity

    def reply(self, dev: int, header: bytes, fd: int, offset: int, size: int) -> None:
        """Send ``header`` and ``size`` bytes of ``fd`` from ``offset`` to ``dev`` as one reply.
        Unspliced if nothing was sent; OSError of the device if the kernel did not take the reply
        (the pipe is empty either way)."""
        try:
            self._fill(header, fd, offset, size)
        except BaseException:
            self.drain()
            raise
        total = len(header) + size
        try:
            sent = os.splice(self.r, dev, total, flags=_NONBLOCK)
        except OSError as e:
            self.drain()
            if e.errno in (errno.EINVAL, errno.ENOMEM, errno.EAGAIN):  # not taken: answer otherwise
                raise Unspliced(f"/dev/fuse refused a spliced reply ({e.strerror})", e.errno == errno.EINVAL) from None
            raise
        if sent != total:  # the kernel takes a reply whole or not at all: a bug if seen
            self.drain()
            raise OSError(errno.EIO, f"a spliced reply of {total} bytes went out as {sent}")

    def _fill(self, header: bytes, fd: int, offset: int, size: int) -> None:
        if os.write(self.w, header) != len(header):
            raise Unspliced("a reply's header did not fit the pipe", False)
        done = 0
        while done < size:
            try:
                n = os.splice(fd, self.w, size - done, offset_src=offset + done, flags=_NONBLOCK)
            except OSError as e:  # EINVAL: this file system cannot splice; EAGAIN: the pipe is full
                raise Unspliced(f"splicing a file into a pipe: {e.strerror}", e.errno == errno.EINVAL) from None
            if n <= 0:  # the file ends early (truncated meanwhile)
                raise Unspliced(f"the file ended {size - done} bytes early", False)
            done += n

    def drain(self) -> None:
        """Empty the pipe (the bytes of a reply not sent)."""
        while True:
            try:
                if not os.read(self.r, 1 << 20):
                    return
            except BlockingIOError:
                return
