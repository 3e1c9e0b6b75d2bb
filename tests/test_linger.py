"""A closed, unchanged snapshot stays loaded for a moment (``reopen_linger``): llama-server opens a
snapshot twice per restore. A reopen takes the loaded content only while the stub still holds the
bytes it was loaded from; anything else loads afresh. The daemons here keep it 30 s (a loaded
machine must not let it expire between a test's steps), except where the expiry is the point."""

from __future__ import annotations

import os
import time

from helpers import rand_bytes, read_direct, wait_closed, write_in_pieces

MiB = 1 << 20
LONG = ["--reopen-linger", "30"]


def _wait_stat(kvfs, key: str, value: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while kvfs.stats()[key] != value:
        assert time.monotonic() < deadline, f"{key} never became {value}: {kvfs.stats()}"
        time.sleep(0.01)


def test_a_reopen_right_after_the_last_close_takes_the_loaded_content(kvfs) -> None:
    kvfs.remount(LONG)
    data = rand_bytes(3 * MiB + 5, 1)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()  # stored: its stub does not change under the lingering content
    wait_closed(kvfs)
    assert read_direct(kvfs.path("s")) == data
    _wait_stat(kvfs, "lingering_files", 1)  # RELEASE comes after close() returns
    before = kvfs.stats()
    assert read_direct(kvfs.path("s")) == data
    after = kvfs.stats()
    assert after["reopens"] - before["reopens"] == 1
    assert after["restores"] == before["restores"], "the same restore as the read before (llama-server's two opens)"


def test_a_lingering_content_is_closed_when_its_time_is_up(kvfs) -> None:
    kvfs.remount(["--reopen-linger", "1"])
    data = rand_bytes(MiB, 10)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    wait_closed(kvfs)
    assert read_direct(kvfs.path("s")) == data
    _wait_stat(kvfs, "lingering_files", 1)
    _wait_stat(kvfs, "lingering_files", 0, timeout=20)  # its pins and buffers let go
    wait_closed(kvfs)
    kvfs.remount(["--reopen-linger", "0"])
    assert read_direct(kvfs.path("s")) == data
    wait_closed(kvfs)
    assert kvfs.stats()["lingering_files"] == 0, "0: closed at the last release, as without it"


def test_a_stub_changed_behind_the_loaded_content_is_loaded_again(kvfs) -> None:
    """The stub replaced without this node knowing (as a fetch from the shared tier installs one):
    the lingering content is not the snapshot any more, and the reopen reads the new one."""
    kvfs.remount(LONG)
    old, new = rand_bytes(2 * MiB, 2), rand_bytes(2 * MiB, 3)
    write_in_pieces(kvfs.path("a"), old, MiB)
    write_in_pieces(kvfs.path("b"), new, MiB)
    kvfs.ingested()
    wait_closed(kvfs)
    assert read_direct(kvfs.path("a")) == old
    _wait_stat(kvfs, "lingering_files", 1)
    snaps = kvfs.store / "snapshots"
    os.replace(snaps / "b", snaps / "a")
    before = kvfs.stats()
    assert read_direct(kvfs.path("a")) == new
    assert kvfs.stats()["reopens"] == before["reopens"], "the lingering content was not taken"


def test_a_content_written_after_its_reopen_does_not_linger_as_the_old_snapshot(kvfs) -> None:
    kvfs.remount(LONG)
    data = rand_bytes(2 * MiB, 4)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    wait_closed(kvfs)
    assert read_direct(kvfs.path("s")) == data
    _wait_stat(kvfs, "lingering_files", 1)
    with open(kvfs.path("s"), "r+b") as f:  # takes the lingering content, then changes it
        f.seek(MiB)
        f.write(b"x" * 4096)
    changed = data[:MiB] + b"x" * 4096 + data[MiB + 4096 :]
    wait_closed(kvfs, timeout=10)  # saved and closed: a changed content does not linger (30 s)
    assert read_direct(kvfs.path("s")) == changed
    kvfs.remount()
    assert read_direct(kvfs.path("s")) == changed


def test_a_truncating_open_replaces_a_lingering_content(kvfs) -> None:
    kvfs.remount(LONG)
    data, nxt = rand_bytes(2 * MiB, 5), rand_bytes(MiB + 77, 6)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    wait_closed(kvfs)
    assert read_direct(kvfs.path("s")) == data
    _wait_stat(kvfs, "lingering_files", 1)
    before = kvfs.stats()["reopens"]
    write_in_pieces(kvfs.path("s"), nxt, MiB)  # O_TRUNC: the next turn's save
    assert kvfs.stats()["reopens"] == before
    assert read_direct(kvfs.path("s")) == nxt
    kvfs.remount()
    assert read_direct(kvfs.path("s")) == nxt


def test_an_unlinked_or_replaced_snapshot_lets_go_of_its_lingering_content_at_once(kvfs) -> None:
    kvfs.remount(LONG)
    for name, seed in (("gone", 7), ("over", 8), ("new", 9)):
        write_in_pieces(kvfs.path(name), rand_bytes(MiB, seed), MiB)
    kvfs.ingested()
    wait_closed(kvfs)
    read_direct(kvfs.path("gone"))
    read_direct(kvfs.path("over"))
    _wait_stat(kvfs, "lingering_files", 2)
    os.unlink(kvfs.path("gone"))
    os.rename(kvfs.path("new"), kvfs.path("over"))
    stats = kvfs.stats()
    assert stats["lingering_files"] == 0 and stats["open_files"] == 0, stats
