"""Healing: a chunk object in the bucket that is not its content is put right.

Never are bytes put under an id they do not hash to, and the server's ETag must be their MD5 (or,
on a server whose ETags are not MD5s, the object fetched must hash to its id). A host that fetches
a chunk failing its id reports it in the bucket; a host that has the chunk uploads it again before
its next upload."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing
from kvchunkfs.store.remotepacked import PackedLayout
from kvchunkfs.store.s3 import ChunkHead, content_etag

log = logging.getLogger(__name__)


class Healing(PackedLayout):
    def _local(self, cid: bytes) -> bytes:
        try:
            return bytes(self.repo.store.get_many([cid])[0])
        except ChunkMissing:
            raise ChunkMissing(f"chunk {cid.hex()} is neither in the local packs nor in the bucket") from None

    def _holds(self, cid: bytes, head: ChunkHead, data: bytes) -> bool:
        """The bucket's object is the chunk's content: its ETag is the content's MD5, or (a server
        whose ETags are not MD5s: SSE-KMS) the object fetched hashes to its id."""
        if not self._etags_are_md5 or head.etag == content_etag(data):
            return True
        try:
            good = hashlib.sha256(self.bucket.get_chunk(cid)).digest() == cid
        except FileNotFoundError:
            return False
        if good:
            self._etags_are_md5 = False  # one good object with another ETag: stop comparing them
            log.info("remote: %s gives ETags that are not MD5s; existing chunks are trusted by key", self.bucket.url)
        return good

    def _put_verified(self, cid: bytes, data: bytes) -> None:
        """Never put bytes under an id they do not hash to; the server's ETag must be their MD5."""
        if hashlib.sha256(data).digest() != cid:
            raise ChunkCorrupt(f"chunk {cid.hex()} read from the local packs fails its checksum: not uploaded")
        etag = self.bucket.put_chunk(cid, data)
        if self._etags_are_md5 and etag and etag != content_etag(data):
            raise OSError(5, f"{self.bucket.url}: chunk {cid.hex()} stored with ETag {etag}, not its content's")
        self._confirm(cid, 0)

    def _heal_one(self, cid: bytes, data: bytes, why: str) -> None:
        log.warning("remote: chunk %s in %s is bad (%s); uploading it again", cid.hex(), self.bucket.url, why)
        with self._confirmed_lock:
            self._confirmed.pop(cid, None)
        if self.layout >= 2:  # a new pack: readers learn its index, and its place replaces the bad one
            self._put_packs([cid])
        else:
            self._put_verified(cid, data)
        self.healed_chunks += 1
        with contextlib.suppress(OSError):
            self.bucket.clear_damaged(cid)

    def _heal(self) -> None:
        """Put right the chunks other hosts reported bad that this host has (at most once per
        ``remote_list_ttl``, before an upload: one LIST, almost always empty)."""
        if time.monotonic() - self._damage_checked < self.list_ttl:
            return
        self._damage_checked = time.monotonic()
        damaged = self.bucket.list_damaged()
        if not damaged:
            return
        have = self.repo.store.has(list(damaged))
        for cid in damaged:
            if cid in have:
                self._heal_one(cid, self._local(cid), "reported by a host that fetched it")

    def _report_corrupt(self, cid: bytes) -> None:
        """A fetched chunk failed its id: say so here (log, metric) and in the bucket (a host that
        has the chunk uploads it again at its next upload)."""
        self.corrupt_chunks += 1
        log.error("remote: chunk %s from %s fails its checksum; reported as damaged", cid.hex(), self.bucket.url)
        try:
            self.bucket.report_damaged(cid)
        except OSError as e:
            log.warning("remote: cannot report chunk %s as damaged: %s", cid.hex(), e)
