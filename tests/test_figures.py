"""One vocabulary for the figures: ``kv-chunk-fs stats``, ``GET /stats`` and ``GET /metrics`` give the
same figure under the same name (docs/api.md, "Figures"), and the save time is the time until the
save is stored, the close apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, write_in_pieces
from test_reporting import metrics

from kvchunkfs.service.apiclient import DaemonClient

MiB = 1 << 20


def stats_cli(store, *flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "stats", "--store", str(store), *flags], env=env,
                          capture_output=True, text=True, check=True, timeout=120).stdout  # fmt: skip


def test_stats_and_metrics_name_the_same_figures_alike(kvfs: Mount) -> None:
    data = rand_bytes(3 * MiB, 7)
    write_in_pieces(kvfs.path("a"), data, MiB)
    write_in_pieces(kvfs.path("b"), data, MiB)  # all deduplicated
    write_in_pieces(kvfs.path("c"), rand_bytes(MiB, 8), MiB)
    kvfs.ingested()
    kvfs.catalog_loaded()
    stats = json.loads(stats_cli(kvfs.store, "--json"))
    m = metrics(kvfs.store)
    assert stats["dedup_ratio"] == pytest.approx(m["kvcfs_dedup_ratio"], rel=1e-3)
    assert stats["dedup_ratio"] == pytest.approx(7 / 4, rel=1e-2), "logical bytes per stored byte"
    assert stats["logical_bytes"] == m["kvcfs_logical_bytes"] == 7 * MiB
    assert stats["stored_bytes"] == m["kvcfs_store_bytes"]
    assert stats["snapshots"] == m["kvcfs_snapshots"] == 3
    assert stats["broken"] == m["kvcfs_snapshots_broken"] == 0
    counters = stats["counters"]
    for name in ("new_bytes", "deduped_bytes", "predicted_bytes", "saves", "restores_to_memory"):
        assert counters[name] == m[f"kvcfs_{name}_total"], name
    assert counters["new_bytes"] == 4 * MiB
    assert "bytes_written" not in counters
    text = stats_cli(kvfs.store)
    assert "new bytes:" in text and "dedup ratio:" in text and "bytes written" not in text


def test_the_save_time_runs_until_the_save_is_stored(kvfs: Mount) -> None:
    for i in range(3):
        write_in_pieces(kvfs.path(f"s{i}"), rand_bytes(2 * MiB, 20 + i), MiB)
    kvfs.ingested()
    history = DaemonClient(kvfs.store).json("GET", "/history")
    saves = history["saves"]
    assert len(saves["seconds"]) == 3 and len(saves["close_seconds"]) == 3
    for stored, closed in zip(saves["seconds"], saves["close_seconds"], strict=True):
        assert stored >= closed > 0
    assert history["latency"]["close"]["count"] == history["latency"]["save"]["count"] == 3
    m = metrics(kvfs.store)
    assert m["kvcfs_close_duration_seconds_count"] == m["kvcfs_save_duration_seconds_count"] == 3
    assert m["kvcfs_save_duration_seconds_sum"] >= m["kvcfs_close_duration_seconds_sum"]
