"""Cross-host refresh: another host saved a newer version of a snapshot this host has; it replaces
the local stub if the local one is still the version last synced (local changes pending upload win)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.store import stubs
from kvchunkfs.store.remotefetch import ReadThrough
from kvchunkfs.store.remotesync import Synced

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A newer version of a local snapshot, fetched from the bucket, waiting for its rename."""

    rel: str
    tmp: Path
    synced: Synced
    local_ctime_ns: int  # of the stub it replaces: changed meanwhile means a local change won

    def current(self, path: Path) -> bool:
        try:
            return os.lstat(path).st_ctime_ns == self.local_ctime_ns
        except OSError:
            return False

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class CrossHostRefresh(ReadThrough):
    def newer_in_bucket(self, rel: str) -> bool:
        """The bucket's listing shows another version of ``rel`` than the one this host last synced
        (another host saved it since). Never blocks: the FUSE thread asks at every lookup."""
        info = self.listing(wait=False).get(rel)
        known = self.db.etag(rel)
        return info is not None and known is not None and info.etag != known

    def prepare_refresh(self, rel: str) -> Fetched | None:
        """The bucket's version of ``rel`` as a complete stub under ``tmp/`` (blocking), if the local
        stub is still the version last synced (else local changes are pending upload: they win)."""
        row = self.db.get(rel)
        path = self.repo.path(rel)
        if row is None:
            return None
        try:
            fd = stubs.open_stub(path)
        except OSError:
            return None
        try:
            local_sha = stubs.hash_stub(fd).digest()  # a piece at a time: never the whole index
            ctime_ns = os.fstat(fd).st_ctime_ns
        finally:
            os.close(fd)
        if local_sha != row.sha:
            return None
        self.check_format()
        fetched = self._fetch_stub(rel, path)  # keeps use count, labels, mode
        if fetched is None:
            return None
        if fetched.obj.etag == row.etag:
            os.unlink(fetched.tmp)
            return None  # the listing was older than what we synced
        return Fetched(rel, fetched.tmp, Synced(fetched.sha, fetched.obj.etag, 0), ctime_ns)

    def refreshed(self, fetched: Fetched) -> None:
        """After the caller renamed ``fetched.tmp`` into place (blocking: SQL)."""
        with contextlib.suppress(OSError):
            fetched.synced.ctime_ns = os.lstat(self.repo.path(fetched.rel)).st_ctime_ns
        self.db.put(fetched.rel, fetched.synced)
        self.mark_partial(fetched.rel)  # the new version's chunks come at the next open
        self.fetched_indexes += 1
        log.info("remote: %s replaced by the bucket's newer version", fetched.rel)
