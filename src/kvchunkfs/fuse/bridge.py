"""The bridge between the kernel's inodes and handles and the files of the store (go-fuse's
``fs/bridge.go``): the inode table, the handle table, lookup counts and forgets.

Inode numbers are ours, not the stubs': a save replaces a stub by rename, which gives it a new
host inode, while the file the kernel knows must keep its identity. ``Node`` maps an inode to its
path under ``snapshots/`` (``None`` once unlinked) and to the shared ``FileContent`` while open; a
node lives while the kernel knows it (its lookup count), while it is open or lingering, and while a
save of it is queued. ``Handle`` is one open of a node. The one-backing-file-per-inode rule of
passthrough and its wait, and the set-id rule, are kept between the session and the filesystem
(fuse/rawbridge.py), on the kernel's inode numbers, as go-fuse's raw bridge keeps them.

All of it runs on the mount's trio thread: no lock.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.handle import FileHandle
from kvchunkfs.file.ingest import Job
from kvchunkfs.fuse import api as fuse
from kvchunkfs.fuse.gate import PathGate


@dataclass(eq=False)
class Restore:
    """One restore of a snapshot: the read-only opens its content serves while it is open or
    lingering. llama-server opens a snapshot twice per restore; both are one restore, counted once
    (``restores``, the use count), timed from its first open to its last close, and reported when
    its content is closed or taken for something else (``Restores.end``, fuse/restores.py)."""

    name: str
    size: int
    source: str  # where its first open found the content: "local packs", "remote" or "memory"
    start: float  # monotonic time its first open arrived
    opens: int = 1
    handles: int = 0  # its handles still open
    closed: float | None = None  # when its last handle so far was released


@dataclass(eq=False)
class Node:
    ino: int
    path: str | None  # relative to snapshots/; "" is the root
    is_dir: bool
    nlookup: int = 0
    opens: int = 0
    content: FileContent | None = None
    lock: trio.Lock = field(default_factory=trio.Lock)
    gate: PathGate = field(default_factory=PathGate)  # its stub renamed in a thread (fuse/gate.py)
    loading: trio.Event | None = None  # set while an open loads the content: later opens wait for it
    lingering: FileContent | None = None  # closed but kept, pins and all, for a reopen (``linger``)
    last_stat: os.stat_result | None = None
    writers: int = 0  # open handles that may write: a read-only open meanwhile is not a restore
    restore: Restore | None = None  # the restore its content serves (open or lingering), if any
    # Times set (utimensat/futimens) on the open file, with the content's generation then: the
    # save's new stub gets them too, unless the file was written after they were set.
    # (atime, mtime, generation, whole file's mtime): a write passed through to the whole file moves
    # no generation, only the file's own mtime.
    set_times: tuple[int | None, int | None, int, int] | None = None
    ingesting: int = 0  # its staged saves queued for ingestion: kept, so renames keep its path
    synced: bytes | None = None  # the checksum of the save a client's fsync stored, while open for writing
    # Staged saves sealed while the writer's file description could still write them (passed
    # through, a child's copy of the descriptor outlives the close): ingested at its last release.
    deferred: list[Job] = field(default_factory=list)
    left: str | None = None  # its last path, once unlinked or renamed over


@dataclass(eq=False)
class Handle:
    node: Node
    file: FileHandle  # its reads and writes
    writer: bool = False
    opener: int | None = None  # process that opened it for writing: its own last close commits (flush)
    restore: Restore | None = None  # the restore this read-only open is part of


class Bridge:
    """The inode and handle tables of one mount."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.by_path: dict[str, Node] = {}
        self.handles: dict[int, Handle] = {}
        self.next_ino = fuse.ROOT_INODE + 1
        self.next_fh = 1
        root = Node(fuse.ROOT_INODE, "", True, nlookup=1)
        self.nodes[root.ino] = root
        self.by_path[""] = root

    def node(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise fuse.FUSEError(errno.ENOENT)
        return node

    def child(self, parent: int, name: bytes) -> str:
        base = self.node(parent).path
        if base is None:
            raise fuse.FUSEError(errno.ENOENT)
        sname = os.fsdecode(name)
        return f"{base}/{sname}" if base else sname

    def remember(self, rel: str, is_dir: bool) -> Node:
        node = self.by_path.get(rel)
        if node is None:
            node = Node(self.next_ino, rel, is_dir)
            self.next_ino += 1
            self.nodes[node.ino] = node
            self.by_path[rel] = node
        return node

    def detach(self, node: Node) -> None:
        """The name is gone; open handles keep the node's content alive."""
        if node.path is not None and self.by_path.get(node.path) is node:
            del self.by_path[node.path]
        node.left, node.path = node.path, None
        self.maybe_drop(node)

    def maybe_drop(self, node: Node) -> None:
        if (
            node.nlookup <= 0
            and node.opens == 0
            and node.lingering is None
            and node.ingesting == 0
            and node.ino != fuse.ROOT_INODE
        ):
            self.nodes.pop(node.ino, None)
            if node.path is not None and self.by_path.get(node.path) is node:
                del self.by_path[node.path]

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            node = self.nodes.get(ino)
            if node is not None:
                node.nlookup -= n
                self.maybe_drop(node)

    def move(self, old: str, new: str) -> None:
        prefix = old + "/"
        for rel in [p for p in self.by_path if p == old or p.startswith(prefix)]:
            node = self.by_path.pop(rel)
            node.path = new + rel[len(old) :]
            self.by_path[node.path] = node

    def stale(self, node: Node) -> bool:
        """The node's name is gone or names another node now (unlinked, renamed over, replaced by
        a fresh inode): an open of it that must load a content answers ESTALE, and the kernel looks
        the name up again and opens what it names now (fs/namei.c, ``LOOKUP_REVAL``)."""
        return node.path is None or self.by_path.get(node.path) is not node

    def in_use(self, rel: str) -> bool:
        node = self.by_path.get(rel)
        return node is not None and (node.content is not None or node.opens > 0)

    def path_of(self, inode: int) -> str | None:
        """The node's path; None for an unlinked one or an unknown inode (the store answers ENOENT)."""
        node = self.nodes.get(inode)
        return node.path if node is not None else None
