"""The systemd units and their settings drop-ins (``kv-chunk-fs install-systemd [--proxy]``;
``deploy/systemd/``): the mount's, and the proxy's (``--proxy``).

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
# A clean stop frees the memory tier (staged saves and hot copies); keep = its hot copies stay in
# memory for the next start (`kv-chunk-fs free-memory-tiers --all` frees a kept one):
Environment=KV_CHUNK_FS_MEMORY_TIER_ON_STOP=free
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


PROXY_UNIT_NAME = "kv-chunk-fs-proxy.service"

PROXY_UNIT = """\
# kv-chunk-fs proxy: llama-server's API with a disk prompt cache on the kv-chunk-fs mount.
# Installed by `kv-chunk-fs install-systemd --proxy`; settings go in {unit}.d/{dropin}
# (or /etc/kv-chunk-fs/config.toml, which the mount's unit reads too), not here.
[Unit]
Description=kv-chunk-fs proxy (disk prompt cache in front of llama-server)
# The mount answers once kv-chunk-fs.service is started (Type=notify); llama-server saves into it.
Wants=kv-chunk-fs.service
After=kv-chunk-fs.service llama-server.service

[Service]
Type=exec
Environment=KVCFS_MOUNTPOINT={mountpoint}
ExecStart={exe} proxy --mount ${{KVCFS_MOUNTPOINT}}
# SIGTERM: stop taking requests, let the saves in flight finish, then exit.
KillSignal=SIGTERM
TimeoutStopSec=90s
Restart=on-failure
RestartSec=2s

[Install]
WantedBy=multi-user.target
"""

PROXY_DROPIN = """\
# Settings of kv-chunk-fs-proxy.service (`systemctl edit kv-chunk-fs-proxy` opens a file like this one).
# Every setting is an environment variable KV_CHUNK_FS_<NAME> (see `kv-chunk-fs proxy --help`);
# the store must be the mount's (its API socket is how the proxy finds stored prompts). After a change:
#   systemctl daemon-reload && systemctl restart kv-chunk-fs-proxy
[Service]
Environment=KVCFS_MOUNTPOINT={mountpoint}
#Environment=KV_CHUNK_FS_PROXY_UPSTREAM=http://127.0.0.1:8080
#Environment=KV_CHUNK_FS_PROXY_LISTEN=127.0.0.1:8081
#Environment=KV_CHUNK_FS_STORE=/var/lib/kv-chunk-fs
#Environment=KV_CHUNK_FS_CACHE_MAX_BYTES=100GiB
"""


def render_proxy_unit(exe: str, mountpoint: str = DEFAULT_MOUNTPOINT) -> str:
    return PROXY_UNIT.format(exe=exe, mountpoint=mountpoint, unit=PROXY_UNIT_NAME, dropin=DROPIN_NAME)


def render_proxy_dropin(mountpoint: str = DEFAULT_MOUNTPOINT) -> str:
    return PROXY_DROPIN.format(mountpoint=mountpoint)


def install_proxy(unit_dir: Path, exe: str, mountpoint: str) -> list[Path]:
    """The proxy's unit and drop-in, as ``install`` writes the mount's. Returns the files written."""
    return _write(unit_dir, PROXY_UNIT_NAME, render_proxy_unit(exe, mountpoint), render_proxy_dropin(mountpoint))


def _write(unit_dir: Path, name: str, unit_text: str, dropin_text: str) -> list[Path]:
    """Write a unit (replacing an older one) and its drop-in (kept if it exists: it is the
    operator's). Returns the files written."""
    unit_dir.mkdir(parents=True, exist_ok=True)
    unit = unit_dir / name
    unit.write_text(unit_text)
    written = [unit]
    dropin = unit_dir / f"{name}.d" / DROPIN_NAME
    if not dropin.exists():
        dropin.parent.mkdir(exist_ok=True)
        dropin.write_text(dropin_text)
        written.append(dropin)
    return written


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
    """The mount's unit (``TimeoutStopSec`` from ``stop_timeout``) and drop-in. Returns the files written."""
    return _write(
        unit_dir, UNIT_NAME, render_unit(exe, mountpoint, stop_timeout), render_dropin(mountpoint, stop_timeout)
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where to write the unit (default %(default)s)")
    p.add_argument("--mountpoint", default=DEFAULT_MOUNTPOINT, help="llama-server's --slot-save-path (%(default)s)")
    p.add_argument("--exe", default=None, help="the kv-chunk-fs command for ExecStart (default: this one)")
    what = "`kv-chunk-fs proxy` on the mount, started after it and llama-server"
    p.add_argument("--proxy", action="store_true", help=f"also write {PROXY_UNIT_NAME}: {what}")
