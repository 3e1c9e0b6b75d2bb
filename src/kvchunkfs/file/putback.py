"""Putting a stored snapshot back into a whole file, in parallel and in bounded memory.

The snapshot's stored stream is read a piece at a time by a few workers (``Restore.scatter``), and
each worker writes the piece it read and checked straight to where the file has its bytes
(``PutBack.write``, safe from any thread: every stored byte has its own place in the file): bytes
outside groups at their own offset; a stored group's (chunker relayout: headers, then one record
per cell holding that cell's row of every block) back to its blocks, one ``pwrite`` per block for
the records of a piece (transposed V: per block and dimension). Nothing holds a whole group, so
memory does not grow with the file: a few pieces and a scratch buffer per worker.

The file's checksum (its record's ``file_sum``) is summed in file order by the caller as the
written part grows (``sum_to``): the bytes that are final (every piece before them written; a
group's, once all its pieces are) are read back from the file a window at a time. It checks the
bytes the file holds. A snapshot without a record (fetched from the bucket, saved before records)
has no checksum to compare: its file is not read back (its chunks were checked against their ids).
Zeros are not written: a hole stays a hole.
"""

from __future__ import annotations

import bisect
import errno
import os
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from kvchunkfs.format.filerecord import file_hasher
from kvchunkfs.format.llama_state import Segment
from kvchunkfs.format.relayout import block_heads, transpose, typed

SUM_WINDOW = 4 << 20  # file bytes read back and summed at a time


def _nonzero(data: np.ndarray) -> bool:
    """Whether ``data`` has a byte that is not zero: its first bytes decide for almost all data."""
    return bool(data[:64].any()) or bool(data.any())


def _write_all(fd: int, data: memoryview | np.ndarray, pos: int) -> None:
    view = (data.data if isinstance(data, np.ndarray) else data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        if n <= 0:
            raise OSError(errno.EIO, f"a whole file's write at {pos} wrote nothing")
        view = view[n:]
        pos += n


class _Group:
    """Where a stored group's bytes go in the file."""

    def __init__(self, seg: Segment) -> None:
        g = seg.group
        assert g is not None and seg.end is not None
        self.seg, self.g = seg, g
        self.heads_at = block_heads(g)  # per block: (header in the stream, in the file, length)
        self.heads = sum(h for _, _, h in self.heads_at)
        self.rec = g.count * g.width
        if self.heads + g.cells * self.rec != seg.end - seg.start:
            raise OSError(errno.EIO, f"a stored group at {seg.start} does not fit its range")
        self.rows = [seg.start + at + h for _hp, at, h in self.heads_at]  # where each block's rows start

    def write(self, fd: int, rel: int, data: np.ndarray, scratch: _Scratch) -> None:
        """The group's stored bytes from group-relative ``rel`` on (never past its end)."""
        if rel < self.heads:
            n = min(len(data), self.heads - rel)
            for hp, at, h in self.heads_at:
                lo, hi = max(rel, hp), min(rel + n, hp + h)
                if lo < hi:
                    _write_all(fd, data[lo - rel : hi - rel], self.seg.start + at + lo - hp)
            rel, data = rel + n, data[n:]
        if not len(data):
            return
        rec = self.rec
        cell, skip = divmod(rel - self.heads, rec)
        if skip:  # the end of a record begun in the piece before
            n = min(len(data), rec - skip)
            self._partial(fd, cell, skip, data[:n])
            cell, data = cell + 1, data[n:]
        whole = len(data) // rec
        if whole:
            self._records(fd, data[: whole * rec].reshape(whole, rec), cell, scratch)
        if whole * rec < len(data):  # the start of a record the next piece ends
            self._partial(fd, cell + whole, 0, data[whole * rec :])

    def _records(self, fd: int, records: np.ndarray, c0: int, scratch: _Scratch) -> None:
        """Whole records of cells ``[c0, c0 + k)``: each block's rows of them where the file has them."""
        g, k = self.g, records.shape[0]
        w = g.width
        out = scratch.take(k * w)
        for i, base in enumerate(self.rows):
            cols = records[:, i * w : (i + 1) * w]
            if not g.el:  # the cells' rows lie back to back in the block
                out.reshape(k, w)[:] = cols
                if _nonzero(out):
                    _write_all(fd, out, base + c0 * w)
                continue
            # Transposed: the block is one run of ``cells`` elements per dimension.
            n = w // g.el
            runs = out.reshape(n, k * g.el)
            per_cell = typed(cols, g.el)  # (k, n) elements, or (k, n, el) bytes
            if per_cell.ndim == 2:
                transpose(typed(runs, g.el), per_cell)
            else:
                runs.reshape(n, k, g.el)[:] = per_cell.transpose(1, 0, 2)
            if not _nonzero(out):
                continue
            run = g.cells * g.el
            for d in range(n):
                _write_all(fd, runs[d], base + d * run + c0 * g.el)

    def _partial(self, fd: int, cell: int, skip: int, data: np.ndarray) -> None:
        """Bytes ``[skip, skip + len(data))`` of the record of ``cell`` (a piece's edge)."""
        g = self.g
        w, el = g.width, g.el
        end = skip + len(data)
        for i, base in enumerate(self.rows):
            lo, hi = max(skip, i * w), min(end, (i + 1) * w)
            if lo >= hi:
                continue
            if not el:
                _write_all(fd, data[lo - skip : hi - skip], base + cell * w + lo - i * w)
                continue
            for x in range(lo, hi):  # transposed: byte ``b`` of element ``d`` of the row, one at a time
                d, b = divmod(x - i * w, el)
                _write_all(fd, data[x - skip : x - skip + 1], base + d * g.cells * el + cell * el + b)


class _Scratch(threading.local):
    """A worker's buffer for one piece's rows of a block (reused: no fresh memory per piece)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)

    def take(self, n: int) -> np.ndarray:
        if len(self.buf) < n:
            self.buf = np.empty(n, np.uint8)
        return self.buf[:n]


class PutBack:
    """The whole file of ``size`` bytes written into the empty plain file ``fd`` from its stored
    stream (``write``, from any thread, pieces in any order), its ``groups`` (stored permuted) put
    back; ``sum_to`` sums it in file order as pieces are written, ``finish`` gives the checksum
    (with ``summed`` false nothing is read back nor summed: ``finish`` gives b"")."""

    def __init__(self, fd: int, size: int, groups: Sequence[Segment], summed: bool = True) -> None:
        self.fd, self.size = fd, size
        self.summing = summed
        found = sorted((g for g in groups if g.group is not None and g.end is not None), key=lambda g: g.start)
        self.groups = [_Group(g) for g in found]
        self._starts = [g.start for g in found]
        self.hasher: xxhash.xxh3_128 = file_hasher()
        self.summed = 0  # file bytes summed so far
        self._scratch = _Scratch()
        self._buf: np.ndarray | None = None  # where ``sum_to`` reads the file back
        os.ftruncate(fd, size)  # the bytes never written (zeros) are a hole

    def _group_at(self, pos: int) -> _Group | None:
        i = bisect.bisect_right(self._starts, pos) - 1
        if i >= 0:
            seg = self.groups[i].seg
            assert seg.end is not None
            if pos < seg.end:
                return self.groups[i]
        return None

    def write(self, pos: int, piece: memoryview | bytes) -> None:
        """The stored stream's bytes at ``pos``, written where the file has them (any thread)."""
        data = np.frombuffer(piece, np.uint8)
        if pos + len(data) > self.size:
            raise OSError(errno.EIO, f"the stored stream runs past its {self.size} bytes")
        while len(data):
            group = self._group_at(pos)
            if group is not None:
                assert group.seg.end is not None
                n = min(len(data), group.seg.end - pos)
                group.write(self.fd, pos - group.seg.start, data[:n], self._scratch)
            else:
                i = bisect.bisect_right(self._starts, pos)
                stop = self._starts[i] if i < len(self._starts) else self.size
                n = min(len(data), stop - pos)
                if _nonzero(data[:n]):  # zeros stay a hole
                    _write_all(self.fd, data[:n], pos)
            pos += n
            data = data[n:]

    def sum_to(self, written: int) -> None:
        """Every stored byte before ``written`` is written: sum the file bytes that are final (a
        group's only once all of it is written), read back into a buffer of ``SUM_WINDOW`` (the
        copy runs without the interpreter lock, beside the workers). Call from one thread,
        ``written`` growing."""
        if not self.summing:
            self.summed = max(self.summed, written)
            return
        group = self._group_at(written) if written < self.size else None
        end = group.seg.start if group is not None and group.seg.start < written else written
        if self._buf is None and end > self.summed:
            self._buf = np.empty(SUM_WINDOW, np.uint8)
        while self.summed < end:
            assert self._buf is not None
            view = self._buf.data[: min(SUM_WINDOW, end - self.summed)]
            n = os.preadv(self.fd, [view], self.summed)
            if n <= 0:
                raise OSError(errno.EIO, f"a whole file put back is short at {self.summed}")
            self.hasher.update(view[:n])
            self.summed += n

    def finish(self) -> bytes:
        """The file's checksum, once every byte was written and summed; EIO if not."""
        if self.summed != self.size:
            raise OSError(errno.EIO, f"the stored stream is {self.size - self.summed} bytes short")
        return self.hasher.digest() if self.summing else b""
