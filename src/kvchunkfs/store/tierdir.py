"""Where a store's memory tier lives, who it belongs to, and giving back tiers nobody serves.

The directory (``tier_dir``) is one no other local user can create first or swap:

- as root: ``/run/kv-chunk-fs/STORE-KEY`` (``/run`` is root's; the daemon mounts a tmpfs of its
  own there, ``memfs``);
- otherwise: ``$XDG_RUNTIME_DIR/kv-chunk-fs/STORE-KEY`` (the user's own runtime directory);
- without one: ``/dev/shm/kv-chunk-fs-UID-RANDOM/STORE-KEY``, a name nobody can guess, made with
  ``mkdir`` (which fails rather than reuse an existing one) and recorded in the store
  (``STORE/whole-dir``) so the next daemon finds it again.

``STORE-KEY`` is the store's real path, hashed. Each tier holds ``owner.json``: the store it
belongs to and whether its daemon keeps it when it stops (``memory_tier_on_stop``). A tier whose
store is gone, or that no daemon serves and whose daemon did not keep it, is freed (its tmpfs
unmounted, its files deleted) at the start of any daemon and by ``free-memory-tiers``
(``sweep``). A tier holding staged saves of a store that still exists is never freed: those
files are snapshots not yet stored.

Earlier versions used ``/dev/shm/kv-chunk-fs-UID/STORE-KEY`` (``legacy_dir``), which another user
could create first. A daemon uses it only if it is its own (mode 0700) and holds staged saves;
one that is not its own is ignored, with one log line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from kvchunkfs.store import memfs
from kvchunkfs.store.layout import LOCK_NAME, Layout

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
RUN = Path("/run/kv-chunk-fs")
RECORD = "whole-dir"  # in the store: the unpredictable directory chosen without a runtime directory
OWNER = "owner.json"


class TierDirError(OSError):
    pass


def store_key(store: Path) -> str:
    return hashlib.sha256(os.fsencode(os.path.realpath(store))).hexdigest()[:16]


def legacy_dir(store: Path) -> Path:
    return SHM / f"kv-chunk-fs-{os.geteuid()}" / store_key(store)


def check_private(path: Path, fix_empty: bool = False) -> None:
    """``path`` is a directory of ours, mode 0700, not a symlink (with ``fix_empty``, an empty one of
    ours made with a wider mode is set to 0700: nothing to protect yet); else TierDirError saying
    how to fix it."""
    st = os.lstat(path)
    ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    if fix_empty and ours and st.st_mode & 0o077 and not os.listdir(path):
        os.chmod(path, 0o700)
        if os.listdir(path):  # another user put something in before the chmod: not ours to trust
            os.chmod(path, stat.S_IMODE(st.st_mode))
        else:
            log.warning("whole-file directory %s had mode %s: set to 0700", path, stat.filemode(st.st_mode))
            st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        fix = f"chmod 700 {path}" if ours else f"chown {os.geteuid()} {path} && chmod 700 {path}, or another directory"
        raise TierDirError(
            errno.EPERM,
            f"the whole-file directory {path} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; another user could read or swap "
            f"snapshots there): {fix}",
        )


def private_dir(path: Path) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private(path)


def _is_private(path: Path) -> bool:
    try:
        check_private(path)
    except OSError:
        return False
    return True


def bases() -> list[Path]:
    """The directories this user's tiers may be in (for ``sweep``)."""
    out = []
    if os.geteuid() == 0:
        out.append(RUN)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        out.append(Path(runtime) / "kv-chunk-fs")
    prefix = f"kv-chunk-fs-{os.geteuid()}"
    with contextlib.suppress(OSError):
        for e in os.scandir(SHM):
            if e.name == prefix or e.name.startswith(prefix + "-"):
                out.append(Path(e.path))
    return [b for b in out if _is_private(b)]


def tier_dir(store: Path) -> tuple[Path, bool]:
    """The store's tier directory (its parents made, checked private) and whether the daemon must
    mount a tmpfs of its own on it (under /run: on disk otherwise). TierDirError if a directory on
    the way is not the daemon's own."""
    key = store_key(store)
    legacy = legacy_dir(store)
    if os.path.lexists(legacy.parent):
        if not _is_private(legacy.parent) or (os.path.lexists(legacy) and not _is_private(legacy)):
            log.warning("%s is not this user's own private directory: not used (another user may have made it)",
                        legacy.parent)  # fmt: skip
        elif _has_staged(legacy):
            log.info("the memory tier stays in %s until its staged saves are stored", legacy)
            return legacy, False
    if os.geteuid() == 0:
        RUN.parent.mkdir(mode=0o755, exist_ok=True)
        private_dir(RUN)
        return RUN / key, True
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _is_private(Path(runtime)):
        base = Path(runtime) / "kv-chunk-fs"
        private_dir(base)
        return base / key, False
    if not SHM.is_dir():
        log.warning("no /dev/shm: staged saves and whole copies go to %s, on the store's disk", store / "whole")
        return store / "whole", False
    return _recorded(store) / key, False


def _recorded(store: Path) -> Path:
    """The unpredictable directory under /dev/shm recorded in the store, made anew if it is gone."""
    record = store / RECORD
    with contextlib.suppress(OSError, ValueError):
        path = Path(record.read_text().strip())
        if path.parent == SHM and path.name.startswith(f"kv-chunk-fs-{os.geteuid()}-") and _is_private(path):
            return path
    for _ in range(8):
        path = SHM / f"kv-chunk-fs-{os.geteuid()}-{secrets.token_hex(16)}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        check_private(path)
        tmp = store / f"{RECORD}.{secrets.token_hex(8)}"
        tmp.write_text(f"{path}\n")
        os.rename(tmp, record)
        return path
    raise TierDirError(errno.EEXIST, "could not make a private directory under /dev/shm")


# -- owners and giving back ---------------------------------------------------------------------


def write_owner(root: Path, store: Path, keep: bool) -> None:
    tmp = root / f"{OWNER}.{secrets.token_hex(8)}"
    tmp.write_text(json.dumps({"store": os.path.realpath(store), "keep": keep}) + "\n")
    os.rename(tmp, root / OWNER)


def read_owner(root: Path) -> dict[str, object] | None:
    try:
        data = json.loads((root / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _served(store: Path) -> bool:
    """Whether a live process holds the store's lock file's pid (a daemon or an offline tool)."""
    try:
        with open(store / LOCK_NAME, "rb") as f:
            pid = int(f.read(32).strip() or b"0")
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _has_staged(root: Path) -> bool:
    try:
        return any(True for _ in os.scandir(root / "staged"))
    except OSError:
        return False


def held_bytes(root: Path) -> int:
    """Bytes of files in a tier (its staged saves and hot copies)."""
    total = 0
    for sub in ("staged", "hot"):
        with contextlib.suppress(OSError):
            for e in os.scandir(root / sub):
                with contextlib.suppress(OSError):
                    total += e.stat(follow_symlinks=False).st_blocks * 512
    return total


def why_orphaned(root: Path, kept_too: bool = False) -> str:
    """Why the tier ``root`` may be freed ("" if it may not); ``kept_too``: also one a stopped
    daemon kept for the next."""
    owner = read_owner(root)
    if owner is None or not isinstance(owner.get("store"), str):
        return ""  # not a tier this version made: left alone
    store = Path(str(owner["store"]))
    if not Layout(store).exists():
        return f"its store {store} is gone"
    if _served(store) or _has_staged(root):
        return ""
    if owner.get("keep") and not kept_too:
        return ""
    return f"no daemon serves its store {store}"


def free(root: Path) -> int:
    """Free a tier: its own tmpfs unmounted, its files deleted; the bytes it held."""
    held = held_bytes(root)
    try:
        memfs.unmount(root)
    except OSError as e:
        log.warning("could not unmount the memory tier %s: %s", root, e)
    shutil.rmtree(root, ignore_errors=True)
    return held


def sweep(skip: Path | None = None, kept_too: bool = False) -> list[tuple[Path, str, int]]:
    """Free every tier of this user's whose store is gone or that no daemon serves and none kept
    (``kept_too``: kept ones too), not ``skip``: (directory, why, bytes freed) for each, logged."""
    freed = []
    mine = os.path.realpath(skip) if skip is not None else None
    for base in bases():
        with contextlib.suppress(OSError):
            for e in os.scandir(base):
                root = Path(e.path)
                if os.path.realpath(root) == mine or not e.is_dir(follow_symlinks=False):
                    continue
                why = why_orphaned(root, kept_too)
                if why:
                    n = free(root)
                    log.warning("freed the memory tier %s (%d MiB): %s", root, n >> 20, why)
                    freed.append((root, why, n))
    return freed
