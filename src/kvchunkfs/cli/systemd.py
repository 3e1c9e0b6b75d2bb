"""The systemd units and their settings drop-ins (``kv-chunk-fs install-systemd [--proxy]``;
``deploy/systemd/``): the mount's, and the proxy's (``--proxy``).

``Type=notify``: the daemon sends ``READY=1`` once the mount answers (``fuse.sdnotify``), so units
ordered after it (llama-server) start on a working directory. Stop (and restart) is SIGTERM, on which
the daemon refuses new writes, waits up to ``stop_timeout`` for the files open for writing to be
closed and saved, then unmounts and closes the store; ``TimeoutStopSec`` is that bound plus
``CLOSE_MARGIN``, so systemd's SIGKILL never cuts the wait short. ``Restart=on-failure`` brings a
crashed daemon back, and mount-time recovery repairs what the crash left.

Every setting given to ``install-systemd`` (a flag, a ``KV_CHUNK_FS_<NAME>`` variable, or a config
file other than /etc/kv-chunk-fs/config.toml) is written into the drop-in as that variable, so the
daemon systemd starts runs with what the command was given; one it cannot write is refused by name
(:func:`assignments`). An existing drop-in is the operator's: only the lines of the settings given
are replaced.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from kvchunkfs.config import CONFIG_ENV, SETTINGS, Config, Setting

UNIT_NAME = "kv-chunk-fs.service"
DROPIN_NAME = "settings.conf"
DEFAULT_MOUNTPOINT = "/srv/kv-slots"
# After the wait for saves: the unmount, then closing the store (a GC walk or compaction under way
# stops, the upload and eviction threads are joined: up to a minute each).
CLOSE_MARGIN = 240
ROOT_CONFIG = "/etc/kv-chunk-fs/config.toml"  # what the daemon, as root, reads without being told

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


# Settings only the proxy reads (the rest are the mount's; these are written into both drop-ins).
PROXY_SETTINGS = frozenset(n for n in SETTINGS if n.startswith("proxy_")) | {"cache_max_bytes"}
SHARED_SETTINGS = frozenset({"store", "log_level"})
# Settings a drop-in cannot carry, and what to do instead.
REFUSED = {
    "api_token": "a unit's environment is readable by every local user (systemctl show): put the token in a "
    "file (mode 0600) and give --api-token-file",
    "proxy_mount": "the proxy's unit uses --mountpoint",
}
# Unit lines a setting also sets: the daemon's stop wait and systemd's bound on it move together.
ALSO = {"stop_timeout": lambda seconds: ("TimeoutStopSec", _span(seconds + CLOSE_MARGIN))}


class Refused(ValueError):
    """Settings the units cannot carry; the message names each and says what to do."""


def _env_value(setting: Setting, value: object) -> str:
    if setting.kind in ("path", "file"):
        return str(Path(str(value)).absolute())
    if setting.kind == "bool":
        return "true" if value else "false"
    return str(value)


def _given(cfg: Config) -> tuple[dict[str, str], list[str]]:
    """(variable -> value of every setting given to this command, names that cannot be written)."""
    out: dict[str, str] = {}
    refused = []
    for name, source in cfg.sources.items():
        if source.startswith("file:") and source != f"file:{ROOT_CONFIG}":  # the daemon reads that file itself
            out[CONFIG_ENV] = str(Path(source.removeprefix("file:")).absolute())
        if not source.startswith(("flag:", "env:")):
            continue
        if name in REFUSED:
            refused.append(name)
            continue
        setting = SETTINGS[name]
        value = getattr(cfg, name)
        out[setting.env] = "" if value is None else _env_value(setting, value)
    return out, refused


def assignments(cfg: Config, proxy: bool) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The drop-in lines (key, value) of the mount's unit and of the proxy's for the settings given:
    ``Environment`` assignments and the unit lines in :data:`ALSO`; :class:`Refused` names the ones
    a unit cannot carry (``api_token``; a proxy setting without ``--proxy``)."""
    given, refused = _given(cfg)
    reasons = [f"{name}: {REFUSED[name]}" for name in refused]
    env_names = {s.env: s.name for s in SETTINGS.values()}
    mount: list[tuple[str, str]] = []
    prox: list[tuple[str, str]] = []
    for var, value in given.items():
        name = env_names.get(var, "")
        line = ("Environment", f"{var}={value}")
        if "\n" in value or "\r" in value:
            reasons.append(f"{name or var}: a unit line cannot hold a line break")
        if name in PROXY_SETTINGS:
            if not proxy:
                reasons.append(f"{name}: a setting of the proxy: add --proxy to write the proxy's unit")
            prox.append(line)
            continue
        mount.append(line)
        if name in SHARED_SETTINGS or var == CONFIG_ENV:
            prox.append(line)
        if name in ALSO:
            mount.append(ALSO[name](getattr(cfg, name)))
    if reasons:
        raise Refused("; ".join(reasons))
    return mount, prox


def _quote(key: str, value: str) -> str:
    """A unit line; an assignment with spaces, quotes or backslashes is quoted as systemd reads it
    (a line break is refused by :func:`assignments`)."""
    value = value.replace("%", "%%")
    if key == "Environment" and any(c in value for c in " \t\"'\\"):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"{key}={value}"


def set_lines(text: str, lines: list[tuple[str, str]]) -> str:
    """``text`` (a drop-in) with ``lines`` in place of the active lines setting the same variable
    (``Environment``) or key (others), added at its end."""
    if not lines:
        return text
    keys = {(k, v.partition("=")[0] if k == "Environment" else "") for k, v in lines}

    def sets(line: str) -> bool:
        key, sep, value = line.partition("=")
        if not sep:
            return False
        value = value.strip().strip('"')
        return (key.strip(), value.partition("=")[0] if key.strip() == "Environment" else "") in keys

    kept = [line for line in text.splitlines() if not sets(line)]
    if not any(line.strip() == "[Service]" for line in kept):
        kept.append("[Service]")
    while kept and not kept[-1].strip():
        kept.pop()
    note = "# Given to `kv-chunk-fs install-systemd`:"
    kept += [] if note in kept else [note]
    return "\n".join([*kept, *(_quote(k, v) for k, v in lines)]) + "\n"


def render_proxy_unit(exe: str, mountpoint: str = DEFAULT_MOUNTPOINT) -> str:
    return PROXY_UNIT.format(exe=exe, mountpoint=mountpoint, unit=PROXY_UNIT_NAME, dropin=DROPIN_NAME)


def render_proxy_dropin(mountpoint: str = DEFAULT_MOUNTPOINT) -> str:
    return PROXY_DROPIN.format(mountpoint=mountpoint)


def install_proxy(unit_dir: Path, exe: str, mountpoint: str, lines: list[tuple[str, str]] | None = None) -> list[Path]:
    """The proxy's unit and drop-in, as ``install`` writes the mount's. Returns the files written."""
    return _write(unit_dir, PROXY_UNIT_NAME, render_proxy_unit(exe, mountpoint), render_proxy_dropin(mountpoint),
                  lines or [])  # fmt: skip


def _write(unit_dir: Path, name: str, unit_text: str, dropin_text: str, lines: list[tuple[str, str]]) -> list[Path]:
    """Write a unit (replacing an older one) and its drop-in with ``lines`` (see :func:`set_lines`);
    an existing drop-in is the operator's: only the lines given are replaced. Returns the files written."""
    unit_dir.mkdir(parents=True, exist_ok=True)
    unit = unit_dir / name
    unit.write_text(unit_text)
    written = [unit]
    dropin = unit_dir / f"{name}.d" / DROPIN_NAME
    old = dropin.read_text() if dropin.exists() else None
    new = set_lines(dropin_text if old is None else old, lines)
    if new != old:
        dropin.parent.mkdir(exist_ok=True)
        dropin.write_text(new)
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


def install(unit_dir: Path, exe: str, mountpoint: str, stop_timeout: int = DEFAULT_STOP_TIMEOUT,
            lines: list[tuple[str, str]] | None = None) -> list[Path]:  # fmt: skip
    """The mount's unit (``TimeoutStopSec`` from ``stop_timeout``) and drop-in with ``lines`` (the
    settings given, :func:`assignments`). Returns the files written."""
    return _write(unit_dir, UNIT_NAME, render_unit(exe, mountpoint, stop_timeout),
                  render_dropin(mountpoint, stop_timeout), lines or [])  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its own options; every setting given too (a flag or KV_CHUNK_FS_<NAME>) goes into the drop-ins."""
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where to write the unit (default %(default)s)")
    p.add_argument("--mountpoint", default=None, help=f"llama-server's --slot-save-path ({DEFAULT_MOUNTPOINT})")
    p.add_argument("--exe", default=None, help="the kv-chunk-fs command for ExecStart (default: this one)")
    what = "`kv-chunk-fs proxy` on the mount, started after it and llama-server"
    p.add_argument("--proxy", action="store_true", help=f"also write {PROXY_UNIT_NAME}: {what}")
