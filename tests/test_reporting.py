"""What the daemon reports about saves and restores, against a real mount: a restore is one
restore however many times llama-server opens the file for it, and every save and restore leaves
one line in the log at the default level (and in ``GET /logs``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from helpers import rand_bytes, wait_closed, write_in_pieces
from prometheus_client.parser import text_string_to_metric_families

from kvchunkfs.service.apiclient import DaemonClient
from kvchunkfs.store import stubs

MiB = 1 << 20
PAUSE = 0.3  # between llama-server's two opens of one restore (the test's own sleep, not a speed)
LINGER = ["--reopen-linger", "5"]  # far longer than PAUSE, even on a loaded machine


def restore_like_llama(path: Path, pause: float = 0.0) -> bytes:
    """llama-server's restore: open, read the header, close; open again, read the file, close."""
    with open(path, "rb") as f:
        f.read(12)
    time.sleep(pause)
    with open(path, "rb") as f:
        return f.read()


def metrics(store: Path) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(DaemonClient(store).text("GET", "/metrics")):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


def use_count(path: Path) -> int:
    try:
        return int(os.getxattr(path, stubs.USE_COUNT))
    except OSError:
        return 0


def log_messages(store: Path) -> list[str]:
    return [line["message"] for line in DaemonClient(store).json("GET", "/logs", {"level": "info"})["lines"]]


def test_the_two_opens_of_a_restore_count_once_and_time_it_whole(kvfs) -> None:
    kvfs.remount(LINGER)
    data = {f"conv-{i}": rand_bytes(2 * MiB + i, 40 + i) for i in range(3)}
    for name, content in data.items():
        write_in_pieces(kvfs.path(name), content, MiB)
    wait_closed(kvfs)
    before, stats_before = metrics(kvfs.store), kvfs.stats()
    for name, content in data.items():
        assert restore_like_llama(kvfs.path(name), PAUSE) == content
    wait_closed(kvfs)  # each restore ends when its content stops lingering
    after, stats = metrics(kvfs.store), kvfs.stats()
    assert stats["restores"] - stats_before["restores"] == 3, stats
    assert after["kvcfs_restores_total"] - before["kvcfs_restores_total"] == 3
    assert after["kvcfs_restore_duration_seconds_count"] - before["kvcfs_restore_duration_seconds_count"] == 3
    assert after["kvcfs_restored_bytes_total"] - before["kvcfs_restored_bytes_total"] == sum(map(len, data.values()))
    history = DaemonClient(kvfs.store).json("GET", "/history")
    assert history["latency"]["restore"]["count"] == 3 and len(history["restores"]["time"]) == 3
    # From the first open to the last close: the pause between the two opens is inside it.
    assert min(history["restores"]["seconds"]) >= PAUSE, history["restores"]
    assert history["restores"]["size"] == [float(len(c)) for c in data.values()]
    assert {name: use_count(kvfs.path(name)) for name in data} == dict.fromkeys(data, 1)

    # Once its content is closed, the next open of the snapshot is the next restore.
    assert restore_like_llama(kvfs.path("conv-0")) == data["conv-0"]
    wait_closed(kvfs)
    assert kvfs.stats()["restores"] - stats_before["restores"] == 4
    assert use_count(kvfs.path("conv-0")) == 2


def test_a_save_and_a_restore_each_log_one_line(kvfs) -> None:
    kvfs.remount(LINGER)
    first = rand_bytes(3 * MiB, 50)
    write_in_pieces(kvfs.path("chat"), first, MiB)
    # A save is logged once it is stored, behind the close; one a later save replaces before it is
    # stored is dropped unlogged, so the next turn comes after this one is stored (as in a chat).
    kvfs.ingested()
    write_in_pieces(kvfs.path("chat"), first + rand_bytes(MiB, 51), MiB)  # the next turn: 1 MiB more
    kvfs.ingested()
    wait_closed(kvfs)
    restore_like_llama(kvfs.path("chat"), PAUSE)
    wait_closed(kvfs)
    saves = [m for m in log_messages(kvfs.store) if m.startswith("saved chat:")]
    assert len(saves) == 2, saves
    stored = r"closed in \d+ ms, stored in \d+ ms"
    assert re.fullmatch(rf"saved chat: 3\.0 MiB, 3\.0 MiB new, {stored}", saves[0]), saves
    size, new = re.fullmatch(rf"saved chat: (4\.0) MiB, ([\d.]+) MiB new, {stored}", saves[1]).groups()  # type: ignore[union-attr]
    assert 1.0 <= float(new) < 2.0, saves[1]  # the new turn, not the whole file
    restores = [m for m in log_messages(kvfs.store) if m.startswith("restored chat:")]
    assert len(restores) == 1, restores
    # The stored save's staged file became a hot copy: the restore reads it whole.
    assert re.fullmatch(r"restored chat: 4\.0 MiB in \d+ ms from a hot copy \(2 opens\)", restores[0]), restores
    # The same lines in the daemon's own log (stderr), at the default level.
    assert kvfs.log().count("INFO kvchunkfs.file.saves: saved chat:") == 2
    assert kvfs.log().count("INFO kvchunkfs.fuse.restores: restored chat:") == 1
