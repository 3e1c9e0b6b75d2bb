"""The open-file cache: one shared ``FileContent`` per open node, loaded by the first of concurrent
opens and closed (or saved, then closed) at the last release.

An unchanged content stays loaded for ``linger`` seconds (``reopen_linger``) after its last close:
llama-server opens a snapshot twice per restore (it reads the end and the header, closes, and opens
it again), and the second open takes the first one's content and its whole file, if
the stub still holds the bytes it was loaded from. An open that must load the content of a node
whose name names another file now answers ESTALE (the kernel looks the name up again).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files
from kvchunkfs.format.index import IndexFormatError
from kvchunkfs.fuse import api as fuse
from kvchunkfs.fuse.bridge import Bridge, Node
from kvchunkfs.fuse.restores import Restores
from kvchunkfs.fuse.retries import StaleRetries
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing

log = logging.getLogger(__name__)

T = TypeVar("T")
OnPath = Callable[[str], None]  # run on a snapshot's path in a worker thread
Commit = Callable[[Node], Awaitable[None]]  # a node's save at its last release (raises FUSEError)


class OpenFiles:
    """The contents of one mount's open (and lingering) nodes (the module's docstring)."""

    def __init__(self, files: Files, bridge: Bridge, restores: Restores, retries: StaleRetries, commit: Commit) -> None:
        self.files = files
        self.bridge = bridge
        self.restores = restores
        self.retries = retries
        self.commit = commit
        self.open_files = 0  # contents loaded (open or lingering); a number other threads can read
        self.linger = 0.0  # seconds an unchanged content stays loaded after its last close (daemon: reopen_linger)
        self.lingering: dict[Node, float] = {}  # node -> when its lingering content is closed
        self.lingered = trio.Event()  # set when a content starts lingering (daemon.close_lingering)
        self.reopens = 0  # opens that took a lingering content
        self.went_idle = trio.Event()  # set when the last open file is released (see daemon.trim_when_idle)
        self.idle_gen = 0  # bumped by every first open and every last release: "still the same idle spell?"

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args)

    async def _load(self, node: Node, allow_broken: bool = False, then: OnPath | None = None) -> FileContent:
        rel = node.path  # under the node's gate: no rename of it meanwhile
        if rel is None:  # unlinked: ``acquire`` answered ESTALE already
            raise fuse.FUSEError(errno.ESTALE)
        try:
            if allow_broken:  # O_TRUNC: the old content is replaced whole, never read
                return await self._thread(self.files.replacement, rel)
            return await self._thread(_and_then, self.files.load, rel, then)
        except (IndexFormatError, OSError, ChunkMissing, ChunkCorrupt) as e:  # OSError: StubError too;
            # a chunk missing or damaged: the put-back of a whole copy at open read it
            if allow_broken and not isinstance(e, FileNotFoundError):
                log.warning("overwriting unreadable snapshot %s: %s", rel, e)
                return await self._thread(self.files.content, self.files.repo.empty_index())
            gone = isinstance(e, FileNotFoundError)  # unlinked behind the open (or the truncate): ENOENT
            log.log(logging.DEBUG if gone else logging.ERROR, "cannot open snapshot %s: %s", rel, e)
            raise fuse.FUSEError(errno.ENOENT if isinstance(e, FileNotFoundError) else errno.EIO) from None

    async def acquire(
        self, node: Node, allow_broken: bool = False, then: OnPath | None = None, made: FileContent | None = None
    ) -> FileContent:
        """The node's shared content, loaded by the first of concurrent opens; counts one open.

        The open is counted before any await, so a release meanwhile does not close the content,
        and a second open waits for the first one's load instead of loading (and pinning) again.
        ``then`` runs on the snapshot's path in the thread that loads it or checks a lingering
        content, if this open does either (a restore's use count: one thread hop, not two).
        ``made``: the content of a file this open created, loaded already (closed if another open
        loaded one meanwhile).
        """
        node.opens += 1
        name = node.path if node.path is not None else node.left  # a rename may replace it meanwhile
        arrival = self.retries.arrival()
        try:
            if made is not None:
                await self._take_made(node, made)
            while node.content is None:
                if node.loading is not None:
                    await node.loading.wait()
                    continue
                node.loading = loaded = trio.Event()
                try:
                    async with node.gate.use():  # the path read in a thread: no rename meanwhile
                        if self.bridge.stale(node):  # its name went while it waited, or before
                            log.debug("open of inode %d: its name names another file now (ESTALE)", node.ino)
                            self.retries.expect(name if name in self.bridge.by_path else None)  # retried there
                            raise fuse.FUSEError(errno.ESTALE)
                        content = await self._revive(node, allow_broken, then)
                        if content is None:
                            content = await self._load(node, allow_broken, then)
                            self.open_files += 1
                    node.content = content
                    self.idle_gen += 1
                finally:
                    node.loading = None
                    loaded.set()
            return node.content
        except BaseException:
            await self.drop_open(node, commit=False)
            raise
        finally:
            if not self.bridge.stale(node):
                self.retries.opened(node.path, arrival)

    async def _take_made(self, node: Node, made: FileContent) -> None:
        kept = node.lingering  # an earlier file's, under this name: not this one
        if kept is not None and node.content is None and node.loading is None:
            node.lingering = None
            self.lingering.pop(node, None)
            self.restores.end(node)
            await self._close_content(kept)
        if node.content is None and node.loading is None:
            node.content = made
            self.open_files += 1
            self.idle_gen += 1
        else:  # the file was opened meanwhile: this open joins that one
            await self._thread(made.close)

    async def drop_open(self, node: Node, commit: bool = True) -> None:
        """One open fewer; the last one saves the content if it changed, then closes it, or keeps
        it loaded for ``linger`` seconds if it is the stub's content unchanged."""
        node.opens -= 1
        content = node.content
        if node.opens == 0 and content is not None:
            try:
                if commit:
                    await self.commit(node)
            except fuse.FUSEError:
                pass  # already logged; the previous version of the snapshot stays
            except Exception:
                log.exception("saving %s on release failed; the previous version stays", node.path)
            finally:
                if node.opens == 0 and node.content is content:
                    node.content = None
                    if self.linger > 0 and node.path is not None and content.loaded_from is not None:
                        node.lingering = content
                        self.lingering[node] = trio.current_time() + self.linger
                        self.lingered.set()
                    else:
                        self.restores.end(node)  # before the close's wait: an open meanwhile is a new one
                        await self._close_content(content)
        self.bridge.maybe_drop(node)

    async def _close_content(self, content: FileContent) -> None:
        await self._thread(content.close)  # unpins: takes store.lock
        self.open_files -= 1  # after the unpin: a test waiting for 0 may collect them
        if self.open_files == 0:
            self.idle_gen += 1
            self.went_idle.set()

    async def _revive(self, node: Node, allow_broken: bool, then: OnPath | None = None) -> FileContent | None:
        """The node's lingering content for this open if the stub still holds the bytes it was
        loaded from (then nothing is read or pinned again); else it is closed, and None. ``then``
        runs in the checking thread if the content is taken."""
        kept = node.lingering
        if kept is None:
            return None
        node.lingering = None
        self.lingering.pop(node, None)
        # Without ``then``, here, not in a thread: a small file read moments ago (as lookup's
        # lstat, no lock, no journal), and a hop to a worker costs more while the first open's
        # decodes run. With it, in the thread ``then`` needs anyway.
        if allow_broken or node.path is None:
            current = False
        elif then is None:
            current = self.files.still_current(node.path, kept)
        else:
            current = await self._thread(_and_then, lambda rel: self.files.still_current(rel, kept), node.path, then)
        if current:
            self.reopens += 1
            return kept
        self.restores.end(node)
        await self._close_content(kept)
        return None

    async def drop_lingering(self, node: Node) -> None:
        """Close the node's lingering content now (at its time, or its name is gone: GC may take
        its chunks once it is unpinned)."""
        kept = node.lingering
        if kept is not None:
            node.lingering = None
            self.lingering.pop(node, None)
            self.restores.end(node)
            await self._close_content(kept)
        self.bridge.maybe_drop(node)

    async def close_lingered(self, now: float | None = None) -> float | None:
        """Close the lingering contents whose time is up (all of them with ``now`` = inf); the
        seconds until the next one is due, or None if none lingers."""
        now = trio.current_time() if now is None else now
        for node in [n for n, due in self.lingering.items() if due <= now]:
            await self.drop_lingering(node)
        if not self.lingering:
            return None
        return max(0.0, min(self.lingering.values()) - trio.current_time())


def _and_then(fn: Callable[[str], T], rel: str, then: OnPath | None) -> T:
    """``fn(rel)``, then ``then(rel)`` if given and ``fn`` did not return False (one thread)."""
    out = fn(rel)
    if then is not None and out is not False:
        then(rel)
    return out
