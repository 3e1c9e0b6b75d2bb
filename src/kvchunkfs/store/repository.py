"""A store directory: stubs, packs and the chunk map, and the one place a save becomes durable.

``Repository`` knows paths relative to ``snapshots/`` and nothing about open files, inodes or
requests. Namespace changes (``install``, ``rename``, ``unlink``, ``rmdir``) are logged with the path they
created, so GC can read again what its walk of ``snapshots/`` may have missed (a directory listing
can miss a stub renamed meanwhile); see docs/design.md, "Garbage collection" and "Concurrency".
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvchunkfs.format.cutter import CUT, CUTS, Cutter
from kvchunkfs.format.index import Index
from kvchunkfs.store import stubs
from kvchunkfs.store.layout import Layout, fsync_dir, fsync_path
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.remote import RemoteTier
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSettings:
    """The settings the store and file layers use (the rest belong to the daemon and the CLI)."""

    chunk_min: int = 16 << 10
    chunk_avg: int = 64 << 10
    chunk_max: int = 256 << 10
    chunker: str = "relayout"  # for new stores: "relayout", "format" or "cdc" (format/cutter.py)
    pack_size: int = 64 << 20
    prefetch_workers: int = 8
    cache_size: int = 128 << 20
    max_file_size: int = 64 << 30
    verify_reads: bool = True
    predict_chunks: bool = True  # skip the cut for chunks that repeat a known sequence (file/predict.py)
    durability: str = "close"  # "close": survives a killed daemon; "fsync": also power loss
    fuse_passthrough: bool = True  # the daemon's (fuse/): negotiate kernel passthrough where possible
    reopen_linger: int = 1  # seconds a closed, unchanged content stays loaded (the daemon's, fuse/)
    whole_files_dir: Path | None = None  # staged saves and hot copies (None: under /dev/shm)
    whole_files_huge_pages: bool = True  # as root: the directory a tmpfs of its own with huge pages
    memory_tier_size: int = 0  # staged saves and hot copies together (0: 1/4 of the machine's memory)
    memory_tier_on_stop: str = "free"  # "free" or "keep" the memory tier when the daemon stops
    hot_tier_size: int = -1  # bytes of whole copies kept for restores (0: none; -1: the tier's)
    warm_up: float = 0.5  # share of the hot budget filled at a mount on an empty tier (file/warmup.py)
    ingest_backlog: int = 0  # staged bytes waiting for ingestion beyond which a close waits (0: 1/2 tier)

    @classmethod
    def from_config(cls, cfg: Any) -> StoreSettings:
        """The fields of this class taken by name from a ``config.Config``."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


class Repository:
    def __init__(self, root: Path, settings: StoreSettings | None = None) -> None:
        self.settings = settings = settings or StoreSettings()
        self.root = root
        self.layout = Layout(root)
        self.layout.create_dirs()
        self.snapshots = self.layout.snapshots
        self.tmp = self.layout.tmp
        self.staging = self.layout.staging
        self.durable = settings.durability == "fsync"
        # durability=close: names whose replaced version is kept in prev/ until a checkpoint makes
        # the new one durable -> the number of their last replace (see ``checkpoint``). The lock
        # guards only the dict, never I/O.
        self._prev_lock = threading.Lock()
        self._kept: dict[str, int] = {}
        self._replaces = 0
        # Paths created by namespace changes since GC's last mark; _ns_lock guards only list
        # operations (never I/O), so the FUSE thread may take it.
        self._ns_lock = threading.Lock()
        self._ns_log: list[str | None] = []
        self._ns_base = 0
        self._ns_busy = 0  # changes begun and not yet ended
        self.ns_gen = 0
        # Called with the paths a change touched, after it (service/live.py): must not block.
        self.watchers: list[Callable[..., None]] = []
        self.store = PackStore(root, settings.pack_size, durable=self.durable)
        # The shared tier (store/remote.py), set by the daemon when ``remote`` is configured; told of
        # every committed namespace change, after it (it only queues the path: never blocks).
        self.remote: RemoteTier | None = None
        self.chunker = self._chunker()
        # Staged saves and the hot tier of whole copies (store/wholefiles.py): set by the daemon
        # at mount; offline tools work on stubs and chunks alone.
        self.whole: WholeFiles | None = None

    def _chunker(self) -> Cutter:
        """Chunk sizes and the cutter are fixed per store at creation, so later saves keep
        deduplicating. A store from before format-aware cutting has sizes but no cutter: plain CDC."""
        s = self.settings
        wanted = f"{s.chunk_min},{s.chunk_avg},{s.chunk_max}"
        stored = self.store.get_meta("chunk_params")
        kind = self.store.get_meta("chunker")
        if kind is None:
            kind = s.chunker if stored is None else "cdc"
            if kind != s.chunker:
                log.info("store %s predates format-aware cutting: it keeps plain CDC", self.root)
            self.store.set_meta("chunker", kind)
        elif kind != s.chunker:
            log.warning("store %s was created with chunker %s; ignoring configured %s", self.root, kind, s.chunker)
        fresh = stored is None
        if stored is None:
            self.store.set_meta("chunk_params", wanted)
            stored = wanted
        elif stored != wanted:
            log.warning("store %s was created with chunk sizes %s; ignoring configured %s", self.root, stored, wanted)
        cmin, cavg, cmax = (int(x) for x in stored.split(","))
        return Cutter(cmin, cavg, cmax, kind, self._cut_version(fresh))

    def _cut_version(self, fresh: bool) -> int:
        """Where the cutter puts its boundaries (``cutter.CUTS``): a new store takes the newest, a
        store that predates the recorded version keeps the first, so its next saves still share
        its chunks."""
        cut = self.store.get_meta("cut")
        if cut is None:
            cut = str(CUT if fresh else 1)
            self.store.set_meta("cut", cut)
        if not cut.isdigit() or int(cut) not in CUTS:
            raise OSError(
                errno.EINVAL, f"store {self.root} was cut with an unknown version {cut!r}: a newer kv-chunk-fs?"
            )
        return int(cut)

    def empty_index(self) -> Index:
        return Index(self.chunker.min, self.chunker.avg, self.chunker.max)

    def path(self, rel: str) -> Path:
        return self.layout.snapshot(rel)

    def read_index(self, rel: str) -> Index:
        """The index of an existing snapshot; StubError for a stub that is not one."""
        return stubs.read_index(self.path(rel))

    def lstat(self, rel: str) -> os.stat_result:
        """The stub's or directory's own status (a symlink's, not its target's)."""
        return os.lstat(self.path(rel))

    def exists(self, rel: str) -> bool:
        """Whether the name exists (a dangling symlink too)."""
        return os.path.lexists(self.path(rel))

    def stub_size(self, rel: str) -> int | None:
        """The size of the snapshot's content: its staged save's if it has one, else its stub's size
        attribute; None if it has no valid one."""
        path = self.path(rel)
        staged = stubs.read_staged(path)
        return staged.size if staged is not None else stubs.stub_size(path)

    def staged(self, rel: str) -> stubs.Staged | None:
        """The snapshot's save not yet ingested (its staged whole file is the snapshot), or None."""
        return stubs.read_staged(self.path(rel))

    def staged_saves(self) -> tuple[list[tuple[str, stubs.Staged]], bool]:
        """Every stub naming a staged save, and whether every stub could be read (else a staged
        file may be named by one that could not): a walk of all stubs (a mount after a stop that
        left staged files behind). Stubs are read by fd, so a path past PATH_MAX is read too."""
        out = []
        complete = True
        for entry in stubs.walk(self.snapshots):
            if entry.skipped is not None:
                continue
            try:
                if entry.error is not None:
                    raise entry.error
                fd = entry.open()
                try:
                    staged = stubs.read_staged(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                log.warning("looking for staged saves: %s: %s", entry.rel, e)
                complete = False
                continue
            if staged is not None:
                out.append((entry.rel, staged))
        return out, complete

    def stage(self, rel: str, name: str, size: int) -> None:
        """The commit point of a staged save: one xattr on the stub names its staged file (``name``,
        ``size`` bytes, written in this boot)."""
        assert self.whole is not None
        path = self.path(rel)
        stubs.set_staged(path, stubs.Staged(name, size, self.whole.boot))
        os.utime(path, follow_symlinks=False)  # modified now, as a stub renamed over it would be
        self.touched(rel)  # the catalog shows the new size

    def unstage(self, rel: str) -> None:
        """Forget a staged save that is lost (its file gone, or from another boot): the stub's
        index, the previous version, is the snapshot again."""
        stubs.set_staged(self.path(rel), None)
        self.touched(rel)

    # -- names and metadata a client makes (through the mount) ---------------------------------
    # Those that change what the catalog shows (a create, the use count, xattrs) tell the watchers
    # themselves, so callers never have to remember to.

    def create(self, rel: str, mode: int, uid: int, gid: int) -> None:
        """A new empty snapshot at ``rel`` (EEXIST if the name exists), owned by ``uid``:``gid``.
        With durability=fsync its stub and its name survive a power cut once this returns; only
        then is it slow (fsyncs): call it in a thread."""
        stubs.create_empty(self.tmp, self.path(rel), self.empty_index(), mode, uid, gid, fsync=self.durable)
        if self.durable:
            self.sync_dirs(rel)
        self.touched(rel)

    def mkdir(self, rel: str, mode: int, uid: int, gid: int) -> None:
        path = self.path(rel)
        os.mkdir(path, mode)
        os.chown(path, uid, gid, follow_symlinks=False)

    def list_dir(self, rel: str) -> list[str]:
        """Sorted names in the directory ``rel`` itself (a symlink put in its place is not followed)."""
        return _list_dir(self.path(rel))

    # Mode, owner and times: of the stub or directory itself, never through a symlink (the daemon,
    # root, would change its target, anywhere). The catalog shows none of them: no watcher is told.

    def set_mode(self, rel: str, mode: int) -> None:
        _chmod_nofollow(self.path(rel), mode)

    def set_owner(self, rel: str, uid: int, gid: int) -> None:
        """-1 keeps that id."""
        os.chown(self.path(rel), uid, gid, follow_symlinks=False)

    def set_times(self, rel: str, atime_ns: int | None, mtime_ns: int | None) -> None:
        """None keeps that time."""
        _set_times(self.path(rel), atime_ns, mtime_ns)

    def note_use(self, rel: str) -> None:
        """A restore of ``rel`` began: its use count and last use move (blocking: xattr writes)."""
        stubs.note_use(self.path(rel))
        self.touched(rel)  # the catalog re-reads use_count/last_use

    # The user attributes of a snapshot as a client sees them: ``user.*`` only, never the internal
    # ones; the managed ones read-only, and under user.kvcfs.* only labels settable. ``rel`` None:
    # the file has no name any more (unlinked while open), ENOENT once the name is checked.

    def get_xattr(self, rel: str | None, name: str) -> bytes:
        if not name.startswith("user.") or name in stubs.INTERNAL:
            raise OSError(errno.ENODATA, f"no attribute {name}")
        return os.getxattr(self.path(_named(rel)), name, follow_symlinks=False)

    def set_xattr(self, rel: str | None, name: str, value: bytes) -> None:
        if not name.startswith("user."):
            raise OSError(errno.ENOTSUP, f"only user.* attributes: {name}")
        _check_settable(name)
        rel = _named(rel)
        os.setxattr(self.path(rel), name, value, follow_symlinks=False)
        self.touched(rel)

    def remove_xattr(self, rel: str | None, name: str) -> None:
        _check_settable(name)
        rel = _named(rel)
        os.removexattr(self.path(rel), name, follow_symlinks=False)
        self.touched(rel)

    def list_xattrs(self, rel: str | None) -> list[str]:
        names = os.listxattr(self.path(_named(rel)), follow_symlinks=False)
        return [n for n in names if n.startswith("user.") and n not in stubs.INTERNAL]

    # -- saving -----------------------------------------------------------------------------

    def prepare_stub(self, index: Index, like: str | None, durable: bool, record: bytes | None = None) -> Path:
        """A complete new stub under ``tmp/`` (metadata carried from ``like``, the file record
        ``record``), fsynced if ``durable``."""
        like_path = self.path(like) if like is not None else None
        tmp = stubs.prepare(self.tmp, index, like_path, fsync=False, record=record)
        with contextlib.suppress(OSError):  # fsck's mark is about the old content, not this one
            os.removexattr(tmp, stubs.BROKEN, follow_symlinks=False)
        if durable:
            fsync_path(tmp)
        return tmp

    def install_staged(self, tmp: Path, rel: str) -> None:
        """Install a staged save's new stub, with the metadata the snapshot has now."""
        stubs.refresh_metadata(tmp, self.path(rel))
        self.install(tmp, rel)

    def install(self, tmp: Path, rel: str) -> None:
        """The commit point of a save: the complete new stub replaces the old one."""
        self._keep_previous(rel)
        with self._changing(rel):
            os.rename(tmp, self.path(rel))
            self.touched(rel)
        if self.remote is not None:
            self.remote.mark_partial(rel, False)  # a save's chunks are all local (written or pinned)
            self.remote.changed(rel)

    def install_fetched(self, tmp: Path, rel: str) -> None:
        """Replace a snapshot by the remote's newer version (not reported back to the remote)."""
        with self._changing(rel):
            os.rename(tmp, self.path(rel))
            self.touched(rel)

    def install_new(self, tmp: Path, rel: str) -> bool:
        """Install a complete stub only if ``rel`` does not exist (a snapshot fetched from the
        remote: a local file always wins). False, and ``tmp`` removed, if it exists."""
        with self._changing(rel):
            try:
                os.link(tmp, self.path(rel))
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            self.touched(rel)
        return True

    def sync(self) -> None:
        """Make every chunk written so far durable (before a stub that names them is renamed)."""
        self.store.sync()

    # -- power loss -------------------------------------------------------------------------

    def _keep_previous(self, rel: str) -> None:
        """durability=close, just before ``rel`` is replaced: hard-link its stub into ``prev/``.

        Nothing of a save is fsynced in this mode, so after a power cut the new stub (or the chunks
        it names) may be gone while its rename survived; the link, a metadata change made before
        the rename, survives with it (file systems journal metadata in order), and recovery puts the
        previous version back. One link per name until the next ``checkpoint``: that one is the
        version that was durable. Costs one link per save; no fsync.
        """
        if self.durable or not _is_file(self.path(rel)):
            return
        name = prev_name(rel)
        if name is None:
            log.debug("%s: name too long to keep its previous version until a checkpoint", rel)
            return
        with self._prev_lock:
            self._replaces += 1
            known = rel in self._kept
            self._kept[rel] = self._replaces
        if known:
            return
        try:
            os.link(self.path(rel), self.layout.prev / name, follow_symlinks=False)
        except FileExistsError:  # kept by an earlier replace whose checkpoint did not finish
            pass
        except OSError as e:  # the save goes on; only its power-loss fallback is missing
            log.warning("cannot keep the previous version of %s: %s", rel, e)

    def checkpoint(self) -> int:
        """durability=close: make the saves that replaced a kept version durable (chunks, map, stubs,
        directories), then drop those versions from ``prev/``. Blocking: a background task every few
        seconds, GC before it runs, unmount. Returns the number of versions dropped."""
        with self._prev_lock:
            kept = dict(self._kept)
        if not kept:
            return 0
        # The bulk of the writeback (the pack saves append to) outside store.lock, which the sync
        # holds across its fsyncs: saves keep appending meanwhile.
        pack = self.store.open_pack
        if pack is not None:
            with contextlib.suppress(OSError), self.store.pack_fd(pack) as fd:
                os.fsync(fd)
        self.store.sync()
        dirs = set()
        for rel in kept:
            path = self.path(rel)
            _fsync_stub(path)
            dirs.add(path.parent)
        for d in dirs:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                fsync_dir(d)
        with self._prev_lock:  # a name replaced again meanwhile keeps its version until the next one
            done = [rel for rel, n in kept.items() if self._kept.get(rel) == n]
            for rel in done:
                del self._kept[rel]
        for rel in done:
            name = prev_name(rel)
            assert name is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.layout.prev / name)
        return len(done)

    def adopt_kept(self) -> int:
        """At mount, after recovery: the versions left in ``prev/`` (kept for a staged save a
        previous daemon had not stored) are dropped by a checkpoint once their names' saves are
        stored, as if kept by this daemon. The number adopted."""
        try:
            names = [e.name for e in os.scandir(self.layout.prev)]
        except FileNotFoundError:
            return 0
        rels = [rel for rel in map(prev_rel, names) if rel is not None]
        with self._prev_lock:
            for rel in rels:
                self._replaces += 1
                self._kept.setdefault(rel, self._replaces)
        return len(rels)

    def whole_stub(self, path: Path) -> bool:
        """A stub that parses and whose every chunk the map has, with the length the index gives it."""
        try:
            index = stubs.read_index(path)
        except OSError:
            return False
        found = self.store.locate_many(index.ids)
        return len(found) == len(set(index.ids)) and self.store.length_mismatch(index, found) is None

    def lose_staged(self, rel: str) -> str:
        """A staged save of ``rel`` that is lost (its file gone, or from another boot): the name
        falls back to the last version stored before it. That is the stub's own index unless it is
        empty (the stub ``create`` made: the save was renamed over the name, or was its first);
        then the version kept in ``prev/`` when the save replaced one (a rename over the name), if
        it is not empty either (an earlier lost save's stub); else the name had no version before
        and is removed. Returns what was done: "index",
        "kept" or "removed". Blocking."""
        path = self.path(rel)
        try:
            own = stubs.read_index(path).size > 0
        except OSError:
            own = True  # not an index: reads of it fail (EIO) as before, nothing is guessed
        name = prev_name(rel)
        kept = self.layout.prev / name if name is not None else None
        if not own and kept is not None and stubs.stub_size(kept) and self.whole_stub(kept):
            with self._changing(rel):
                os.rename(kept, path)
            with self._prev_lock:
                self._kept.pop(rel, None)
            stubs.set_staged(path, None)  # its own staged save, if any, is older still: gone too
            fsync_dir(path.parent)  # put back for good: a cut now must not bring the empty stub back
            self.touched(rel)
            return "kept"
        if not own:
            self.unlink(rel)
            fsync_dir(path.parent)
            return "removed"
        self.unstage(rel)
        return "index"

    def sync_dirs(self, *rels: str) -> None:
        """durability=fsync, after a namespace change: the directories holding ``rels`` (blocking)."""
        for d in {self.path(rel).parent for rel in rels}:
            fsync_dir(d)

    def sync_entries(self, rel: str) -> None:
        """A client's fsyncdir: the directory's entries survive a power cut, and so does every
        snapshot they name (in close mode: its chunks, the map and its stub first). Blocking."""
        path = self.path(rel)
        if not self.durable:
            self.store.sync()
            for entry in os.scandir(path):
                if entry.is_file(follow_symlinks=False):
                    _fsync_stub(Path(entry.path))
        fsync_dir(path)

    # -- namespace --------------------------------------------------------------------------

    def rename(self, old: str, new: str) -> None:
        src, dst = self.path(old), self.path(new)
        carried = None
        if _is_file(dst) and _is_file(src):
            stubs.carry_metadata(dst, src)
            self._keep_previous(new)
            carried = self._carry_version(src, dst)
        with self._changing(new):
            if carried is None:
                os.rename(src, dst)
            else:  # the name first, then the source goes (a crash between: see ``_carry_version``)
                os.rename(carried, dst)
                os.unlink(src)
            self.touched(old, new)
        if self.remote is not None:
            self.remote.renamed(old, new)
            self.remote.changed(new, old)  # the new name up before the old one goes: never neither

    def _carry_version(self, src: Path, dst: Path) -> Path | None:
        """A staged save renamed over a name (``NAME.tmp`` over ``NAME``, before it is stored)
        must not take the name's version with it: the source's stub holds no version of its own
        (the empty index ``create`` made), and if the save is lost (a reboot) the name falls back to
        the index beside its staged name. So the stub put in place is the source's (its metadata
        and staged name) with the target's index and file record: as if the save had been made on
        the name itself. Returns that stub under ``tmp/`` (None: a plain rename does). A crash
        between its rename and the source's unlink leaves the source naming the same staged save
        with its empty index: ingestion stores it once, and a lost save of a name with no version
        removes the name (``lose_staged``)."""
        if self.durable:
            return None
        try:
            staged = stubs.read_staged(src)
            if staged is None or stubs.read_index(src).size > 0:
                return None
            index = stubs.read_index(dst)
            if index.size == 0:
                return None
            tmp = stubs.prepare(self.tmp, index, src, record=stubs.read_record(dst))
        except OSError as e:  # a plain rename: the name's version is then kept in prev/ alone
            log.warning("renaming a staged save over %s: its version not carried: %s", dst.name, e)
            return None
        try:
            stubs.refresh_metadata(tmp, src)
            stubs.set_staged(tmp, staged)
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def unlink(self, rel: str) -> None:
        with self._changing(None):
            os.unlink(self.path(rel))
            self.touched(rel)
        if self.remote is not None:
            self.remote.mark_partial(rel, False)
            self.remote.changed(rel)

    def rmdir(self, rel: str) -> None:
        with self._changing(None):
            os.rmdir(self.path(rel))

    def touched(self, *rels: str) -> None:
        """Tell the watchers that ``rels`` changed (also for metadata and creates made elsewhere)."""
        for watch in self.watchers:
            watch(*rels)

    @contextlib.contextmanager
    def _changing(self, created: str | None) -> Iterator[None]:
        """Around a namespace change and the report of it to the watchers: the generation moves
        when it starts and when it ends, and GC sweeps only while none is in flight (``ns_settled``).
        A walk or a catalog refresh running beside a rename across directories can see the old
        name gone and the new one not yet there; so GC must know the change began."""
        with self._ns_lock:
            self._ns_log.append(None)  # one entry per generation; None: nothing new to read
            self.ns_gen += 1
            self._ns_busy += 1
        try:
            yield
        finally:
            with self._ns_lock:
                self._ns_log.append(created)  # logged once done: a catch-up then finds it there
                self.ns_gen += 1
                self._ns_busy -= 1

    def ns_settled(self, gen: int) -> bool:
        """No namespace change began or ended since generation ``gen`` and none is in flight."""
        with self._ns_lock:
            return self.ns_gen == gen and self._ns_busy == 0

    def ns_mark(self) -> int:
        """GC, before its walk: forget older changes and return the current generation."""
        with self._ns_lock:
            self._ns_log.clear()
            self._ns_base = self.ns_gen
            return self.ns_gen

    def created_since(self, gen: int) -> tuple[int, list[str]]:
        """(current generation, paths created by namespace changes since ``gen``, a mark or later)."""
        with self._ns_lock:
            new = self._ns_log[max(0, gen - self._ns_base) :]
            return self.ns_gen, [p for p in new if p is not None]

    def close(self) -> None:
        self.checkpoint()
        self.store.close()


PREV_NAME_MAX = 240  # a file name in prev/ (most file systems allow 255 bytes)


def prev_name(rel: str) -> str | None:
    """The name in ``prev/`` of the kept version of ``rel`` (its path, base64); None if too long."""
    name = base64.urlsafe_b64encode(os.fsencode(rel)).decode()
    return name if len(name) <= PREV_NAME_MAX else None


def prev_rel(name: str) -> str | None:
    """The snapshot path a name in ``prev/`` keeps a version of; None for a name that is not one."""
    try:
        rel = os.fsdecode(base64.urlsafe_b64decode(name.encode()))
    except (binascii.Error, ValueError):
        return None
    return rel if rel and prev_name(rel) == name else None


def _named(rel: str | None) -> str:
    if rel is None:
        raise FileNotFoundError(errno.ENOENT, "the file has no name any more")
    return rel


def _check_settable(name: str) -> None:
    """EPERM for an attribute the filesystem maintains or one under user.kvcfs.* that is not a label."""
    if name in stubs.MANAGED or (name.startswith(stubs.XATTR_PREFIX) and not stubs.is_user_settable(name)):
        raise PermissionError(errno.EPERM, f"{name} is not settable")


def _fsync_stub(path: Path) -> None:
    """fsync the stub at ``path`` if it is a regular file (never through a symlink, never blocking on a FIFO)."""
    try:
        fd = stubs.open_stub(path)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_file(path: Path) -> bool:
    """A regular file itself, not what a symlink points at."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _list_dir(path: os.PathLike[str]) -> list[str]:
    """Sorted names in the directory ``path`` itself (a symlink put in its place is not followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def _set_times(path: os.PathLike[str], atime_ns: int | None, mtime_ns: int | None) -> None:
    """utime of the stub itself (never a symlink's target); None keeps that time."""
    st = os.lstat(path)
    os.utime(
        path,
        ns=(st.st_atime_ns if atime_ns is None else atime_ns, st.st_mtime_ns if mtime_ns is None else mtime_ns),
        follow_symlinks=False,
    )


def _chmod_nofollow(path: os.PathLike[str], mode: int) -> None:
    """chmod that never follows a symlink (Linux has no lchmod; this is what glibc's fchmodat does)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.EOPNOTSUPP, "a symlink has no mode of its own", os.fspath(path))
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)
