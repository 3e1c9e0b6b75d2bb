"""The systemd unit and its settings drop-in (``kv-chunk-fs install-systemd``; ``deploy/systemd/``).

``Type=notify``: the daemon sends ``READY=1`` once the mount answers (``fuse.sdnotify``), so units
ordered after it (llama-server) start on a working directory. Stop (and restart) is SIGTERM, on which
the daemon refuses new writes, waits up to ``stop_timeout`` for the files open for writing to be
closed and saved, then unmounts and closes the store; ``TimeoutStopSec`` is that bound plus
``CLOSE_MARGIN``, so systemd's SIGKILL never cuts the wait short. ``Restart=on-failure`` brings a
crashed daemon back, and mount-time recovery repairs what the crash left.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from kvchunkfs.config import SETTINGS

UNIT_NAME = "kv-chunk-fs.service"
DROPIN_NAME = "settings.conf"
DEFAULT_MOUNTPOINT = "/srv/kv-slots"
# After the wait for saves: the unmount, then closing the store (a GC walk or compaction under way
# stops, the upload and eviction threads are joined: up to a minute each).
CLOSE_MARGIN = 240

UNIT = """\
# kv-chunk-fs: deduplicating FUSE filesystem for llama-server's --slot-save-path.
# Installed by `kv-chunk-fs install-systemd`; settings go in {unit}.d/{dropin}
# (or /etc/kv-chunk-fs/config.toml), not here.
[Unit]
Description=kv-chunk-fs (KV-cache snapshot store for llama-server)
After=local-fs.target
Before=llama-server.service

[Service]
Type=notify
NotifyAccess=main
Environment=KVCFS_MOUNTPOINT={mountpoint}
# "-": after a crash the mountpoint is a dead FUSE mount that mkdir cannot stat; the daemon clears it.
ExecStartPre=-/bin/mkdir -p ${{KVCFS_MOUNTPOINT}}
ExecStart={exe} mount ${{KVCFS_MOUNTPOINT}}
# SIGTERM: refuse new writes, let the files open for writing be closed and saved (up to
# stop_timeout, {stop_timeout}), then unmount. TimeoutStopSec must stay longer than stop_timeout.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStartSec=15min
TimeoutStopSec={timeout_stop}
Restart=on-failure
RestartSec=2s
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""

DROPIN = """\
# Settings of kv-chunk-fs.service (`systemctl edit kv-chunk-fs` opens a file like this one).
# Every setting is an environment variable KV_CHUNK_FS_<NAME> (see `kv-chunk-fs config --help`);
# a TOML file at /etc/kv-chunk-fs/config.toml works as well. After a change:
#   systemctl daemon-reload && systemctl restart kv-chunk-fs
[Service]
Environment=KVCFS_MOUNTPOINT={mountpoint}
#Environment=KV_CHUNK_FS_STORE=/var/lib/kv-chunk-fs
#Environment=KV_CHUNK_FS_CACHE_SIZE=512MiB
#Environment=KV_CHUNK_FS_GC_INTERVAL=3600
#Environment=KV_CHUNK_FS_API_ADDRESS=127.0.0.1:9464
#Environment=KV_CHUNK_FS_API_TOKEN_FILE=/etc/kv-chunk-fs/api-token
# How long a stop waits for the saves in flight; a longer one needs TimeoutStopSec = it + {margin}:
#Environment=KV_CHUNK_FS_STOP_TIMEOUT={stop_timeout}
#TimeoutStopSec={timeout_stop}
"""


DEFAULT_STOP_TIMEOUT: int = SETTINGS["stop_timeout"].default


def _span(seconds: int) -> str:
    """A systemd time span: ``5min`` rather than ``300``."""
    return f"{seconds // 60}min" if seconds % 60 == 0 else f"{seconds}s"


def render_unit(exe: str, mountpoint: str = DEFAULT_MOUNTPOINT, stop_timeout: int = DEFAULT_STOP_TIMEOUT) -> str:
    return UNIT.format(exe=exe, mountpoint=mountpoint, unit=UNIT_NAME, dropin=DROPIN_NAME,
                       stop_timeout=_span(stop_timeout), timeout_stop=_span(stop_timeout + CLOSE_MARGIN))  # fmt: skip


def render_dropin(mountpoint: str = DEFAULT_MOUNTPOINT, stop_timeout: int = DEFAULT_STOP_TIMEOUT) -> str:
    return DROPIN.format(mountpoint=mountpoint, margin=_span(CLOSE_MARGIN), stop_timeout=stop_timeout,
                         timeout_stop=_span(stop_timeout + CLOSE_MARGIN))  # fmt: skip


def default_exe() -> str:
    """The command that is running, as it was called (/usr/local/bin/kv-chunk-fs, the symlink setup.sh
    makes, stays valid when the virtual environment behind it is made again); else the one on PATH;
    else this interpreter with the module."""
    running = os.path.abspath(sys.argv[0])
    if os.path.basename(running) == "kv-chunk-fs" and os.access(running, os.X_OK):
        return running
    return shutil.which("kv-chunk-fs") or f"{sys.executable} -m kvchunkfs.cli"


def install(unit_dir: Path, exe: str, mountpoint: str, stop_timeout: int = DEFAULT_STOP_TIMEOUT) -> list[Path]:
    """Write the unit (replacing an older one; ``TimeoutStopSec`` from ``stop_timeout``) and the
    drop-in (kept if it exists: it is the operator's). Returns the files written."""
    written = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    unit = unit_dir / UNIT_NAME
    unit.write_text(render_unit(exe, mountpoint, stop_timeout))
    written.append(unit)
    dropin = unit_dir / f"{UNIT_NAME}.d" / DROPIN_NAME
    if not dropin.exists():
        dropin.parent.mkdir(exist_ok=True)
        dropin.write_text(render_dropin(mountpoint, stop_timeout))
        written.append(dropin)
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where to write the unit (default %(default)s)")
    p.add_argument("--mountpoint", default=DEFAULT_MOUNTPOINT, help="llama-server's --slot-save-path (%(default)s)")
    p.add_argument("--exe", default=None, help="the kv-chunk-fs command for ExecStart (default: this one)")
