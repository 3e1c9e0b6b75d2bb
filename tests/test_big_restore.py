"""A snapshot too big for the memory tier: its open puts it back into a whole file on the store's
disk (an anonymous file under ``staging/``), served from that file like any other, and nothing of
it is left on disk once closed, nor after a kill -9 and the next mount."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import Mount
from helpers import rand_bytes

from e2e import ggsq

MiB = 1 << 20
SMALL_TIER = ["--memory-tier-size", "16MiB", "--reopen-linger", "0"]


def disk_copies(m: Mount) -> list[str]:
    """The daemon's open descriptors of files under its store's ``staging/``."""
    assert m.proc is not None
    staging = os.path.realpath(m.store / "staging")
    out = []
    fds = Path(f"/proc/{m.proc.pid}/fd")
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(staging + "/"):
            out.append(target)
    return out


def settle(m: Mount, timeout: float = 30) -> None:
    """Until the daemon has had every release (the kernel sends it after close() returned)."""
    deadline = time.monotonic() + timeout
    while m.stats()["open_files"] or m.stats().get("lingering_files", 0):
        assert time.monotonic() < deadline, m.log()[-3000:]
        time.sleep(0.02)


def test_a_snapshot_larger_than_the_memory_tier_is_put_back_on_disk_and_leaves_nothing(kvfs: Mount) -> None:
    spec = ggsq.Spec(n_layer=6, row_bytes=512, v_trans=True)
    files = {
        "state": ggsq.synthetic_bytes(ggsq.synthetic_tokens(9000, 3), spec),  # stored groups to put back
        "random": rand_bytes(40 * MiB, 11),
    }
    for name, data in files.items():
        kvfs.path(name).write_bytes(data)
    kvfs.ingested()
    kvfs.remount(SMALL_TIER)  # the hot copies go: more than the tier's budget
    for name, data in files.items():
        assert len(data) > 8 * MiB, "more than half the tier: not put back in memory"
        before = kvfs.stats()
        with open(kvfs.path(name), "rb", buffering=0) as f:
            copies = disk_copies(kvfs)
            assert len(copies) == 1 and copies[0].endswith("(deleted)"), copies
            got = bytearray()
            while piece := f.read(4 * MiB):
                got += piece
            assert bytes(got) == data, name
            st = kvfs.stats()
            assert st["restores_to_disk"] - before["restores_to_disk"] == 1
            assert st["restore_disk_copies"] == 1
        settle(kvfs)
        assert disk_copies(kvfs) == [] and kvfs.stats()["restore_disk_copies"] == 0
        assert not any((kvfs.store / "staging").iterdir())
        assert not any((kvfs.whole / "hot").iterdir()), "no hot copy of a file over the budget"
    # A crash while one is open: nothing on disk once the next daemon is up, and the snapshot is
    # put back again, byte for byte.
    f = open(kvfs.path("random"), "rb", buffering=0)  # noqa: SIM115 - the daemon dies under it
    try:
        assert len(disk_copies(kvfs)) == 1
        kvfs.kill()
    finally:
        try:
            f.close()
        except OSError:
            pass
    kvfs.start_settled(SMALL_TIER)
    assert not any((kvfs.store / "staging").iterdir())
    assert kvfs.path("random").read_bytes() == files["random"]
    settle(kvfs)
    assert disk_copies(kvfs) == [] and not any((kvfs.store / "staging").iterdir())
