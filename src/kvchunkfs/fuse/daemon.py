"""Mounting: the FUSE session, signals, kernel read-ahead tuning and background tasks."""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import resource
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import cast

import trio

from kvchunkfs.file.files import Files
from kvchunkfs.file.warmup import WarmUp, tier_empty
from kvchunkfs.fuse import api, mounts
from kvchunkfs.fuse.operations import Operations
from kvchunkfs.fuse.prefault import prefault_libraries
from kvchunkfs.fuse.sdnotify import notify
from kvchunkfs.fuse.session import Session
from kvchunkfs.fuse.stop import stop_on_signals
from kvchunkfs.store import tierdir
from kvchunkfs.store.pressure import PressureWatcher
from kvchunkfs.store.wholefiles import open_whole_files

log = logging.getLogger(__name__)

BackgroundTask = Callable[[Operations], Awaitable[None]]
STOP_TIMEOUT = 60.0  # seconds a signal waits for the saves in flight (setting stop_timeout)


def clear_stale_mount(mountpoint: Path) -> None:
    """A killed daemon leaves 'Transport endpoint is not connected' behind; detach it."""
    try:
        os.statvfs(mountpoint)  # not os.stat: the kernel may answer that from its attribute cache
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            log.warning("%s is a dead mount of a previous run; unmounting it", mountpoint)
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


def check_mountpoint(mountpoint: Path, nonempty: bool = False) -> str | None:
    """Why ``mountpoint`` should not be mounted on, or None. A dead mount of a killed daemon is cleared
    first. A live FUSE mount (or a directory in one) is refused, naming what serves it: a second
    mount would hide the first. A non-empty directory is refused unless ``nonempty``: its files would
    vanish under the mount, and they are usually full, undeduplicated saves llama-server made while
    nothing was mounted."""
    clear_stale_mount(mountpoint)
    try:
        live = mounts.fuse_mount_of(mountpoint)
        with os.scandir(mountpoint) as it:
            first = next(it, None)
    except OSError as e:
        return f"cannot use {mountpoint} as the mountpoint: {e.strerror or e}"
    if live is not None:
        return mounts.describe(live, mountpoint)
    if first is not None and not nonempty:
        return (f"{mountpoint} is not empty (it holds {first.name!r}, among others perhaps); the mount would hide "
                "its files. Move them away, or mount over them with --nonempty")  # fmt: skip
    return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
ARENAS = 4  # glibc's default is 8 per core: each thread's arena keeps its own high-water mark
TRIM_THRESHOLD = 64 << 20  # free heap kept for reuse; more is returned to the kernel


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc


def tune_process() -> None:
    """Process settings for a daemon that moves hundreds of MB through Python buffers.

    Every FUSE write arrives as a fresh 1 MiB bytes object. Keeping freed memory in the heap
    (no per-buffer mmap/munmap) avoids page faults and TLB shootdowns between the FUSE thread and
    the chunking threads; a shorter GIL switch interval lets the FUSE thread answer while a chunker
    thread is busy. But the heap must not keep every peak: with a 512 MiB trim threshold and an
    arena per thread, RSS climbed past 1 GB over repeated saves (tests/test_soak.py), so arenas
    are few, trimming starts at 64 MiB, and ``trim_memory`` runs once no file has been open for
    ``IDLE_TRIM_DELAY`` (``trim_when_idle``).
    """
    sys.setswitchinterval(0.001)
    raise_fd_limit()
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.mallopt(M_ARENA_MAX, ARENAS)


IDLE_TRIM_DELAY = 2.0  # seconds with no file open before the heap may be trimmed
# Trimmed only above this RSS (setting memory_trim_above): every page given back is faulted in again
# by the next save (6-10% more CPU per save), so a heap that fits beside the default 256 MiB chunk
# cache is kept.
TRIM_ABOVE_RSS = 448 << 20


def trim_memory() -> None:
    """Return the free pages of every arena to the kernel (blocking: a few ms; run in a thread)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def raise_fd_limit() -> int:
    """Raise the soft limit on open fds to the hard one: pack fds are an LRU, but every open
    snapshot, client connection and worker holds fds too. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open file limit from %d to %d: %s", soft, hard, e)
    return soft


def mount_options(allow_other: bool, store: Path | None = None) -> set[str]:
    """``store``: named in the mount table (fuse/mounts.py)."""
    name = mounts.fsname(store) if store is not None else mounts.FSNAME
    opts = set(api.default_options) | {f"fsname={name}", "subtype=kv-chunk-fs"}
    if allow_other:
        opts.add("allow_other")  # llama-server may run as another user than the daemon
    return opts


def serve(
    files: Files,
    mountpoint: Path,
    kernel_readahead_kb: int = 4096,
    background: list[BackgroundTask] | None = None,
    trim_above: int = TRIM_ABOVE_RSS,
    stop_timeout: float = STOP_TIMEOUT,
) -> Operations:
    """Mount and serve until SIGINT/SIGTERM or an external unmount; always unmounts. A signal lets
    the saves in flight finish first, for up to ``stop_timeout`` seconds (fuse/stop.py)."""
    clear_stale_mount(mountpoint)
    tune_process()
    log.info("library code prefaulted: %d MiB", prefault_libraries() >> 20)
    s = files.repo.settings
    whole = open_whole_files(files.repo.root, s.whole_files_dir, s.hot_tier_size, s.whole_files_huge_pages,
                             s.memory_tier_size, s.memory_tier_on_stop == "keep")  # fmt: skip
    files.repo.whole = whole
    whole.stub_path = files.repo.path
    files.repo.watchers.append(whole.changed)
    tierdir.sweep(skip=whole.root)  # tiers whose store is gone or that no daemon serves
    watcher = PressureWatcher(whole)
    watcher.start()
    warm = WarmUp(files, whole, s.warm_up)  # a tier found empty: the likeliest restores put back, once mounted
    empty = tier_empty(whole)
    ops = Operations(files)
    ops.warm_up_stats = warm.stats
    ops.opened.linger = files.repo.settings.reopen_linger
    ops.save_service.stop_timeout = stop_timeout
    ops.mountpoint = str(mountpoint.resolve())
    session = Session(ops, str(mountpoint), mount_options(os.geteuid() == 0, files.repo.root))
    session.start()
    log.info("mounted %s on %s", files.repo.root, mountpoint)
    try:
        tasks: list[BackgroundTask] = [
            partial(trim_when_idle, above=trim_above),
            checkpoints,
            close_lingering,
            *(background or []),
        ]
        if empty:
            tasks.append(partial(start_warm_up, warm))
        tasks.append(partial(stop_on_signals, terminate=session.terminate, bound=stop_timeout))
        trio.run(_main, session, mountpoint, kernel_readahead_kb, tasks)
    finally:
        warm.close()
        session.close(unmount=True)
        watcher.close()
        log.info("unmounted %s", mountpoint)
    whole.stop()  # a clean stop: the tier freed or kept, as the operator chose
    return ops


async def start_warm_up(warm: WarmUp, ops: Operations) -> None:
    """Start the warm-up (its own thread), once the saves staged before the last stop are resumed."""
    warm.start()


CHECKPOINT_INTERVAL = 5.0  # seconds: with durability=close, the saves a power cut may take back


async def checkpoints(ops: Operations, interval: float = CHECKPOINT_INTERVAL) -> None:
    """durability=close: every ``interval`` seconds, make the saves that replaced a version durable
    and drop the versions kept for them (``Repository.checkpoint``), in a thread."""
    repo = ops.repo
    while not repo.durable:
        await trio.sleep(interval)
        try:
            await trio.to_thread.run_sync(repo.checkpoint)
        except OSError as e:  # the versions stay kept; the next checkpoint tries again
            log.warning("checkpoint failed: %s", e)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def trim_when_idle(ops: Operations, delay: float = IDLE_TRIM_DELAY, above: int = TRIM_ABOVE_RSS) -> None:
    """Give the heap's free pages back once the mount has been idle for ``delay`` seconds and RSS
    is above ``above``.

    Not at every last close, nor below the bound: the next save would fault its buffers in again
    (measured: 6-10% more daemon CPU per save). RSS stays bounded between turns without taxing
    every turn.
    """
    while True:
        await ops.opened.went_idle.wait()
        ops.opened.went_idle = trio.Event()
        gen = ops.opened.idle_gen
        await trio.sleep(delay)
        if ops.opened.open_files == 0 and ops.opened.idle_gen == gen:
            if rss_bytes() > above:
                await trio.to_thread.run_sync(trim_memory)
                ops.memory_trims += 1
            ops.idle_checks += 1


async def close_lingering(ops: Operations) -> None:
    """Close each lingering content once its ``linger`` seconds are up."""
    while True:
        await ops.opened.lingered.wait()
        ops.opened.lingered = trio.Event()
        while (wait := await ops.opened.close_lingered()) is not None:
            with trio.move_on_after(wait):
                await ops.opened.lingered.wait()  # a new one may be due sooner: look again
            ops.opened.lingered = trio.Event()


async def _main(session: Session, mountpoint: Path, readahead_kb: int, background: list[BackgroundTask]) -> None:
    ops = cast(Operations, session.ops)  # or nullfs's (benchmarks/nullfs.py), which runs no background task
    if isinstance(ops, Operations) and ops.repo.whole is not None:
        ops.save_service.start_ingestion()
        await ops.save_service.resume_staged()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_tune_bdi, mountpoint, readahead_kb)
        nursery.start_soon(_ready, mountpoint)
        for task in background:
            nursery.start_soon(task, ops)
        await session.run(min_tasks=4, max_tasks=64)
        nursery.cancel_scope.cancel()
    if isinstance(ops, Operations):  # (benchmarks/nullfs.py runs this loop too)
        await ops.opened.close_lingered(math.inf)  # unpinned and their buffers back before the store closes
        await ops.save_service.stop_ingestion()


async def _ready(mountpoint: Path) -> None:
    """Tell systemd we are ready once the mount answers: a statvfs served by this very loop (so
    ``systemctl start`` returns only when llama-server can use the directory)."""
    await trio.to_thread.run_sync(os.statvfs, mountpoint)
    notify(f"READY=1\nSTATUS=serving {mountpoint}\nMAINPID={os.getpid()}")


DIRTY_LIMIT = 32 << 20  # dirty page-cache bytes the kernel may hold for the mount


async def _tune_bdi(mountpoint: Path, readahead_kb: int) -> None:
    """Tune the mount's backing device (root only).

    read_ahead_kb: the kernel sends large, overlapping reads. max_bytes: with the writeback cache
    the kernel would otherwise sit on up to ~1% of RAM of a save before sending it; a smaller
    limit makes it stream writes to us while the client is still writing, so chunking overlaps.
    """
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for name, value in (("read_ahead_kb", readahead_kb), ("max_bytes", DIRTY_LIMIT)):
        if value <= 0:
            continue
        try:
            await trio.to_thread.run_sync((bdi / name).write_text, str(value))
            log.info("%s of %s set to %d", name, mountpoint, value)
        except OSError as e:
            log.warning("could not set %s: %s", bdi / name, e)
