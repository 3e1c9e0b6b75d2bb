"""The store's and the read path's counters, as a mount reports them (``user.kvcfs.stats``,
the API's ``/stats``, ``/metrics``): chunks written and deduplicated, pack reads, put-backs (memory or
disk), restore buffers, predicted bytes, the checksum checks. Plain numbers: safe from any thread."""

from __future__ import annotations

from kvchunkfs.file.files import Files


def read_path_counters(files: Files) -> dict[str, int]:
    c = files.repo.store.counters
    return {
        "chunks_written": c.chunks_written,
        "bytes_written": c.bytes_written,
        "chunks_deduped": c.chunks_deduped,
        "bytes_deduped": c.bytes_deduped,
        "pack_reads": c.pack_reads,
        "pack_bytes_read": c.pack_bytes_read,
        "pack_direct_reads": c.direct_reads,
        "chunks_read": files.restore.stats.chunks_read,
        "restores_to_memory": files.restore.stats.to_memory,
        "restores_to_disk": files.restore.stats.to_disk,
        "restore_disk_copies": files.restore.stats.disk_copies_open,
        "restore_buffers_reused": files.buffers.reused,
        "bytes_predicted": files.successors.predicted_bytes if files.successors else 0,
        "file_order_saves": files.checks.file_order_saves,
        "checksum_mismatches": files.checks.mismatches,
    }
