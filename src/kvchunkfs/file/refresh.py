"""The remote tier seen from a mount: read-through of a name or a directory the bucket has and this
host lacks (``from_remote``), and the cross-host refresh of a name another host saved since this
host last synced it (``refresh_from_remote``). On the mount's trio thread; the network in threads.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

import trio

from kvchunkfs.store.remote import RemoteTier
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)


async def from_remote(remote: RemoteTier | None, step: str, rel: str) -> bool:
    """Read-through (in a thread: network): ``RemoteTier.lookup`` or ``fill_dir``. An unreachable
    bucket is logged and answered from local state only."""
    if remote is None:
        return False
    try:
        return bool(await trio.to_thread.run_sync(getattr(remote, step), rel))
    except (OSError, ValueError) as e:
        log.warning("remote %s of %s failed: %s", step, rel, e)
        return False


async def refresh_from_remote(
    repo: Repository, rel: str, in_use: Callable[[str], bool], replaced: Callable[[str], object]
) -> None:
    """Last writer wins across hosts: if another host saved ``rel`` since this host last synced
    it, and it is not open here, the bucket's version replaces the local stub, and the name gets
    a fresh inode (the kernel forgets the old version's pages and size, as after a rename):
    ``replaced(rel)``, on this thread right after the stub is replaced. ``in_use(rel)``: the name
    is open here (or loaded), so its local version stays."""
    remote = repo.remote
    if remote is None or not remote.newer_in_bucket(rel) or in_use(rel):
        return
    try:
        fetched = await trio.to_thread.run_sync(remote.prepare_refresh, rel)
    except (OSError, ValueError) as e:
        log.warning("remote refresh of %s failed: %s", rel, e)
        return
    if fetched is None:
        return
    # Here, on the FUSE thread, the rename is ordered with saves, renames and unlinks.
    if in_use(rel) or not fetched.current(repo.path(rel)):
        await trio.to_thread.run_sync(fetched.discard)  # a local change came first: it will be uploaded
        return
    try:
        repo.install_fetched(fetched.tmp, rel)
    except OSError as e:  # the local version stays; the next lookup tries again
        log.warning("remote refresh of %s failed: %s", rel, e)
        await trio.to_thread.run_sync(fetched.discard)
        return
    replaced(rel)  # the name gets a fresh inode: the old one lives on until the kernel forgets it
    try:
        await trio.to_thread.run_sync(remote.refreshed, fetched)
    except (OSError, sqlite3.Error) as e:  # the next mount re-checks it (same bytes, same ETag)
        log.warning("remote refresh of %s not recorded: %s", rel, e)
