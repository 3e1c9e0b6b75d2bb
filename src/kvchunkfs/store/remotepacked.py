"""The packed layout of the bucket (layout 2): the pack indexes this host learns, the packs it
puts (each pack index naming up to 64 packs), and where it found each chunk (``remote.db``)."""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future

from kvchunkfs.store import remotepacks as rp
from kvchunkfs.store.remotecore import TierCore
from kvchunkfs.store.s3 import NotItsName, TooLarge

log = logging.getLogger(__name__)

_PACKIDX_SKEW_US = 3600 * 10**6  # pack indexes are listed from this long before the newest one read


class PackedLayout(TierCore):
    def _learn(self, force: bool = False) -> None:
        """Read the pack indexes this host has not read yet: a LIST of those named from an hour
        before the newest one read (writers' clocks may differ that much), or with ``force`` (a
        restore that misses) of all; then a GET per new one. At most once per ``remote_list_ttl``
        unless ``force``."""
        with self._learn_lock:
            if not force and time.monotonic() - self._learned_at < self.list_ttl:
                return
            newest = self.db.newest_packidx()
            since = None if force or newest is None else max(0, int(newest[:16], 16) - _PACKIDX_SKEW_US)
            listed = self.bucket.list_packidx(since)
            known = self.db.read_packidx(f"{since:016x}" if since is not None else "")
            # oldest first: a chunk put again (healed) is found where the newer pack index says
            for name in sorted(listed.keys() - known):
                try:
                    self.db.learned(name, rp.decode(self.bucket.get_packidx(name, rp.MAX_PIDX_BYTES)))
                except FileNotFoundError:
                    continue  # deleted by gc --remote meanwhile: its packs are gone
                except (rp.PackIndexError, TooLarge, NotItsName) as e:
                    log.error("remote: pack index %s in %s is invalid, ignored: %s", name, self.bucket.url, e)
            self._learned_at = time.monotonic()

    @staticmethod
    def _by_pack(known: dict[bytes, tuple[rp.Loc, float]]) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for cid, (loc, _) in known.items():
            out.setdefault(loc.pack, []).append(cid)
        return out

    def _put_packs(self, cids: list[bytes]) -> None:
        done: list[rp.PackDesc] = []
        pending: collections.deque[tuple[rp.PackDesc, Future[None]]] = collections.deque()
        packer = rp.Packer(self.pack_size)

        def send(full: tuple[rp.PackDesc, bytes] | None) -> None:
            if full is None:
                return
            desc, data = full
            pending.append((desc, self._uploads.submit(self.bucket.put_pack, desc.pack, data)))
            while len(pending) > 2:  # a few packs in memory at once
                d, f = pending.popleft()
                f.result()
                done.append(d)

        for i in range(0, len(cids), 64):
            part = cids[i : i + 64]
            for cid, data in zip(part, self.repo.store.get_many(part), strict=True):  # each checked against its id
                send(packer.add(cid, data))
        send(packer.flush())
        for d, f in pending:
            f.result()
            done.append(d)
        for group in rp.groups(done):
            name = self.bucket.put_packidx(rp.encode(group))
            self.db.learned(name, group)
            self.db.seen([g.pack for g in group], time.time())
            for g in group:
                for cid, _ in g.chunks:
                    self._confirm(cid, 0)
