"""What every command shares: opening the store the settings name, and saying in one line what an
operator can fix (a read-only or full file system, a wrong owner or mode, a missing directory)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvchunkfs.config import Config
from kvchunkfs.store.repository import Repository, StoreSettings


def open_repo(cfg: Config) -> Repository:
    return Repository(Path(cfg.store), StoreSettings.from_config(cfg))


def _owner(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f" (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; you are uid {os.geteuid()})"


def operator_error(e: OSError) -> str:
    """One line for an OSError: the path, what is wrong and the fix."""
    path = e.filename if isinstance(e.filename, str) else os.fsdecode(e.filename) if e.filename else ""
    what = e.strerror or str(e)
    where = f"{path}: " if path and path not in what else ""
    if e.errno == errno.EROFS:
        fix = "remount it read-write (mount -o remount,rw), or set --store to a writable directory"
    elif e.errno in (errno.EACCES, errno.EPERM) and path:
        fix = f"run as the owner of {path} or as root, or give it to this user (chown/chmod){_owner(path)}"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "the file system is full: free space (df), run `kv-chunk-fs gc`, or move the store"
    elif e.errno == errno.ENOENT and path:
        fix = "it does not exist: create it or correct the path"
    else:
        return f"{where}{what}"
    return f"{where}{what}; {fix}"


def writable_problem(store: Path) -> str | None:
    """Why a command that writes cannot write the store directory (or the parts of it that exist),
    in one line with the fix, or None."""
    for path in (store, store / "chunks.db", store / "packs", store / "snapshots"):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            return operator_error(e)
        want = os.W_OK | os.R_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)
        if os.access(path, want):
            continue
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return operator_error(OSError(errno.EROFS, f"the store {store} is on a read-only file system", str(path)))
        return operator_error(OSError(errno.EACCES, f"cannot write {path}", str(path)))
    return None
