"""Settings with provenance.

Each setting is taken from the highest of these layers that sets it:

1. built-in defaults (source ``default``);
2. the TOML config file, a flat table whose keys are the setting names (``file:/path``). The file is
   ``--config PATH`` or ``$KV_CHUNK_FS_CONFIG`` (must exist), else ``/etc/kv-chunk-fs/config.toml`` as
   root or ``~/.config/kv-chunk-fs/config.toml`` otherwise (used only if it exists);
3. environment variables ``KV_CHUNK_FS_<NAME>`` (``env:KV_CHUNK_FS_CHUNK_AVG``);
4. command-line flags ``--<name-with-dashes>`` (``flag:--chunk-avg``).

Every layer's values are checked, even ones a higher layer overrides, so a broken file fails loudly.
Sizes take ints or ``64KiB``/``32MiB``/``1GiB`` (binary; bare ``K``/``M``/``G``/``T`` too) or
``500MB`` (decimal). Durations take seconds or ``1h``, ``30m``, ``10s``, ``1d``, ``1h30m``.
Booleans take true/false/1/0/yes/no/on/off outside TOML. A relative ``store`` in the config file is
relative to the file's directory; from the environment or a flag, to the working directory.

The default ``score`` ranks snapshots for eviction (lowest goes first)::

    (1 + use_count) / (1 + idle_hours) / (1 + unique_bytes / 1048576)

i.e. how often and how recently a snapshot is restored (LFU x LRU), per MiB that evicting it would
actually free: shared chunks stay in the store for the other snapshots, so only ``unique_bytes`` count.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvchunkfs.formula import FormulaError, compile_formula
from kvchunkfs.units import GiB, KiB, MiB, format_duration, format_size, is_int, parse_duration, parse_size

ENV_PREFIX = "KV_CHUNK_FS_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
DEFAULT_SCORE = "(1 + use_count) / (1 + idle_hours) / (1 + unique_bytes / 1048576)"
# Settings that no longer have an effect: a config file or the environment may still set them (one
# warning line each: a config written for an older version still mounts); the flag is gone.
RETIRED = {
    "readahead": "every open reads a whole file put back before the open returns; there is nothing to read ahead",
    "writeback_cache": "every write goes to a whole file the kernel writes directly",
    "chunk_workers": "a save is stored by one thread reading it, its chunks hashed on every core",
}


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting is invalid; the message names the key and where its value came from."""


def _is_root() -> bool:
    return os.geteuid() == 0


def _home(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME")
    return Path(home) if home else Path.home()


def _default_store(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if _is_root():
        return Path("/var/lib/kv-chunk-fs")
    data_home = environ.get("XDG_DATA_HOME") or str(_home(environ) / ".local" / "share")
    return Path(data_home) / "kv-chunk-fs"


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where the config file is looked for when neither ``--config`` nor ``$KV_CHUNK_FS_CONFIG`` is set."""
    environ = os.environ if environ is None else environ
    if _is_root():
        return Path("/etc/kv-chunk-fs/config.toml")
    config_home = environ.get("XDG_CONFIG_HOME") or str(_home(environ) / ".config")
    return Path(config_home) / "kv-chunk-fs" / "config.toml"


# --- value parsers: raw value -> typed value, ValueError("reason") on failure -------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_int(value: object) -> int:
    if is_int(value):
        return value  # type: ignore[return-value]
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    raise ValueError("not an integer")


def _parse_float(value: object) -> float:
    if is_int(value) or isinstance(value, float):
        result = float(value)  # type: ignore[arg-type]
    elif isinstance(value, str):
        try:
            result = float(value)
        except ValueError:
            raise ValueError("not a number") from None
    else:
        raise ValueError("not a number")
    if result != result:  # NaN would pass every range check
        raise ValueError("not a number")
    return result


def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ValueError("not a boolean (use true/false, yes/no, 1/0)")


def _parse_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value


def _parse_formula(value: object) -> str:
    text = _parse_str(value)
    try:
        compile_formula(text)
    except FormulaError as e:
        raise ValueError(f"bad score formula: {e}") from None
    return text


def _parse_address(value: object) -> str:
    text = _parse_str(value).strip()
    if not text:
        return ""
    if text.lstrip(":").isdigit():  # a bare port (8765 or :8765) listens on loopback only
        text = "127.0.0.1:" + text.lstrip(":")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("not host:port (e.g. 127.0.0.1:8765)")
    return text


def _parse_tenant(value: object) -> str:
    text = _parse_str(value).strip()
    if text.lower() in ("none", "api-key"):
        return text.lower()
    kind, _, header = text.partition(":")
    if kind.lower() != "header" or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", header):
        raise ValueError("must be none, api-key or header:NAME (e.g. header:X-User)")
    return f"header:{header.lower()}"


def _parse_remote(value: object) -> str:
    text = _parse_str(value).strip()
    if text and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^/].*)?", text.rstrip("/")):
        raise ValueError("not s3://bucket or s3://bucket/prefix")
    return text.rstrip("/")


# --- the settings table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting: how to parse it, its default, its bounds and its help text."""

    name: str
    kind: str  # size, duration, int, float, bool, choice, str, address, formula, remote, tenant, path, file (optional)
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_PARSERS: dict[str, Callable[[object], Any]] = {
    "size": parse_size,
    "duration": parse_duration,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "str": _parse_str,
    "address": _parse_address,
    "formula": _parse_formula,
    "remote": _parse_remote,
    "tenant": _parse_tenant,
}

# Chunk bounds are pyfastcdc's, so a bad value fails here rather than at the first write.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("store", "path", None, "chunk store directory"),
        Setting("chunk_min", "size", 16 * KiB, "minimum chunk size", lo=64, hi=MiB),
        Setting("chunk_avg", "size", 64 * KiB, "average chunk size", lo=256, hi=4 * MiB),
        Setting("chunk_max", "size", 256 * KiB, "maximum chunk size", lo=KiB, hi=16 * MiB),
        Setting(
            "chunker",
            "choice",
            "relayout",
            "how a new store cuts files: relayout (as format, and K/V blocks stored token-major), "
            "format (llama.cpp state files at their structure, else CDC) or cdc",
            choices=("relayout", "format", "cdc"),
        ),
        Setting("pack_size", "size", 64 * MiB, "pack file size before a new pack is started", lo=1),
        Setting("prefetch_workers", "int", 8, "threads reading packs to put snapshots back", lo=1, hi=64),
        Setting(
            "cache_size",
            "size",
            128 * MiB,
            "memory kept in buffers that restores and saves reuse (faulted in at mount)",
            lo=0,
        ),
        Setting(
            "max_file_size",
            "size",
            64 * GiB,
            "largest file; writes and truncates beyond it fail (EFBIG)",
            lo=1,
            hi=1 << 50,
        ),
        Setting("kernel_readahead_kb", "int", 4096, "kernel read-ahead of the mount (0 = leave)", lo=0),
        Setting(
            "reopen_linger",
            "duration",
            1,
            "seconds a snapshot closed unchanged stays loaded for the next open (0 = none)",
            lo=0,
            hi=3600,
        ),
        Setting("verify_reads", "bool", True, "check chunk hashes on read"),
        Setting(
            "predict_chunks",
            "bool",
            True,
            "saving: bytes that hash to the chunk that followed the last one before are not cut again",
        ),
        Setting(
            "fuse_passthrough",
            "bool",
            True,
            "let the kernel serve open files from their backing files where it can (Linux 6.9+, root; "
            "off = every byte through the daemon)",
        ),
        Setting(
            "whole_files_dir",
            "file",
            None,
            "where staged saves and the hot tier's whole copies live, a private directory (empty = "
            "/dev/shm/kv-chunk-fs-UID/STORE-KEY: memory, kept across daemon restarts, not reboots)",
        ),
        Setting(
            "whole_files_huge_pages",
            "bool",
            True,
            "as root, mount a private tmpfs with transparent huge pages on the whole-file directory "
            "(in memory, holding no staged save): whole files are written and read several times "
            "faster than on /dev/shm's 4 KiB pages; it stays mounted across daemon restarts",
        ),
        Setting(
            "memory_tier_size",
            "size",
            0,
            "memory for staged saves and hot copies together (0 = a quarter of the machine's memory, or of "
            "the daemon's cgroup limit if smaller); hot copies give way to staged saves",
            lo=0,
        ),
        Setting(
            "memory_tier_on_stop",
            "choice",
            "free",
            "when the daemon stops cleanly: free the memory tier (hot copies deleted, its tmpfs unmounted "
            "once no staged save is left) or keep it for the next daemon",
            choices=("free", "keep"),
        ),
        Setting(
            "hot_tier_size",
            "size",
            -1,
            "bytes of whole copies of recent snapshots kept for plain-speed restores, least recently used "
            "evicted (-1 = as much of memory_tier_size as staged saves leave; 0 = keep none)",
            lo=-1,
        ),
        Setting(
            "warm_up",
            "float",
            0.5,
            "at a mount that finds the memory tier empty (a reboot, a new directory), the share of the hot "
            "copies' budget the daemon fills in the background with the most recently used snapshots, "
            "yielding to clients' restores and saves (0 = off)",
            lo=0,
            hi=1,
        ),
        Setting(
            "ingest_backlog",
            "size",
            0,
            "bytes of closed saves not yet stored as chunks beyond which the next close waits (0 = half "
            "of memory_tier_size); closes also wait while storing them would take more than 5 s",
            lo=0,
        ),
        Setting(
            "memory_trim_above",
            "size",
            448 * MiB,
            "when idle, give free heap memory back to the system if the daemon's RSS is above this (0 = always)",
            lo=0,
        ),
        Setting(
            "stop_timeout",
            "duration",
            60,
            "on SIGTERM/SIGINT, seconds to wait for files open for writing to be closed and saved before "
            "unmounting anyway (keep it below the unit's TimeoutStopSec; 0 = do not wait)",
            lo=0,
            hi=86400,
        ),
        Setting("gc_interval", "duration", 3600, "seconds between GC runs (0 = no periodic GC)", lo=0),
        Setting(
            "gc_walk_interval",
            "duration",
            86400,
            "a GC run reads every stub at least this often (others look only at what changed; 0 = at mount only)",
            lo=0,
        ),
        Setting("gc_compact_threshold", "float", 0.5, "compact packs whose live share falls below this", lo=0, hi=1),
        Setting("durability", "choice", "close", "when data is durable", choices=("close", "fsync")),
        Setting("api_address", "address", "", "host:port of the HTTP API; a bare port means 127.0.0.1 (empty = off)"),
        Setting("api_token", "str", "", "bearer token required by the API"),
        Setting("api_token_file", "file", None, "file holding the API's bearer token (not shown by ps, unlike a flag)"),
        Setting(
            "api_insecure_no_token",
            "bool",
            False,
            "serve the TCP API without a token: anyone who can connect may delete snapshots",
        ),
        Setting("proxy_upstream", "str", "http://127.0.0.1:8080", "proxy: the llama-server it forwards to"),
        Setting("proxy_listen", "address", "127.0.0.1:8081", "proxy: host:port it serves clients on"),
        Setting(
            "proxy_mount",
            "file",
            None,
            "proxy: the mounted directory llama-server saves into (its --slot-save-path); required by proxy",
        ),
        Setting(
            "proxy_min_restore",
            "int",
            32,
            "proxy: restore a snapshot only if it brings at least this many more prompt tokens than the slot holds",
            lo=1,
        ),
        Setting(
            "proxy_max_body",
            "size",
            16 * MiB,
            "proxy: largest request body; a larger one is refused with 413 before it is read",
            lo=KiB,
        ),
        Setting(
            "proxy_max_prompt_tokens",
            "int",
            0,
            "proxy: longest prompt in tokens, refused with 400 before the proxy copies it "
            "(0 = the upstream's context size per slot)",
            lo=0,
        ),
        Setting(
            "proxy_tenant",
            "tenant",
            "none",
            "proxy: whose stored conversations a request may restore: none (any: one user or one team), "
            "api-key (only those saved with the same Authorization header) or header:NAME (the same value "
            "of that header, set by a gateway in front)",
        ),
        Setting(
            "cache_max_bytes",
            "size",
            0,
            "proxy: past this many stored bytes, delete the lowest-score proxy snapshots (0 = no budget)",
            lo=0,
        ),
        Setting("remote", "remote", "", "shared chunk tier: s3://bucket/prefix (empty = this host only)"),
        Setting("remote_endpoint", "str", "", "S3 endpoint URL, e.g. http://127.0.0.1:8333 (empty = AWS)"),
        Setting("remote_upload_workers", "int", 16, "threads uploading chunks to the remote", lo=1, hi=256),
        Setting("remote_fetch_workers", "int", 16, "threads fetching chunks from the remote", lo=1, hi=256),
        Setting(
            "remote_grace",
            "duration",
            86400,
            "gc --remote keeps an unnamed remote chunk younger than this (uploads in flight)",
            lo=0,
        ),
        Setting(
            "remote_pack_size",
            "size",
            16 * MiB,
            "a new bucket's layout: chunks uploaded in packs of about this size (0: one object per chunk, "
            "desync-compatible)",
            lo=0,
            hi=1 << 30,
        ),
        Setting("remote_list_ttl", "duration", 5, "seconds a listing of the remote's snapshots is reused", lo=0),
        Setting(
            "local_cache_size",
            "size",
            0,
            "with remote: past this many pack bytes, evict chunks safely in the bucket, least recently used "
            "snapshots first (they stay listed and are fetched back when opened; 0 = keep everything)",
            lo=0,
        ),
        Setting("score", "formula", DEFAULT_SCORE, "snapshot score formula; lowest is evicted first"),
        Setting("log_level", "choice", "info", "log level", choices=("debug", "info", "warning", "error")),
    )
}


@dataclass(frozen=True)
class Config:
    """Effective settings; ``sources[name]`` says where each value came from.

    One field per row of ``SETTINGS``, with the row's default (checked below at import), so a new
    setting is one row plus one field here; flags, env names and help come from the row.
    """

    store: Path = field(default_factory=_default_store)
    chunk_min: int = SETTINGS["chunk_min"].default
    chunk_avg: int = SETTINGS["chunk_avg"].default
    chunk_max: int = SETTINGS["chunk_max"].default
    chunker: str = SETTINGS["chunker"].default
    pack_size: int = SETTINGS["pack_size"].default
    prefetch_workers: int = SETTINGS["prefetch_workers"].default
    cache_size: int = SETTINGS["cache_size"].default
    max_file_size: int = SETTINGS["max_file_size"].default
    kernel_readahead_kb: int = SETTINGS["kernel_readahead_kb"].default
    reopen_linger: int = SETTINGS["reopen_linger"].default
    verify_reads: bool = SETTINGS["verify_reads"].default
    predict_chunks: bool = SETTINGS["predict_chunks"].default
    fuse_passthrough: bool = SETTINGS["fuse_passthrough"].default
    whole_files_dir: Path | None = SETTINGS["whole_files_dir"].default
    whole_files_huge_pages: bool = SETTINGS["whole_files_huge_pages"].default
    memory_tier_size: int = SETTINGS["memory_tier_size"].default
    memory_tier_on_stop: str = SETTINGS["memory_tier_on_stop"].default
    hot_tier_size: int = SETTINGS["hot_tier_size"].default
    warm_up: float = SETTINGS["warm_up"].default
    ingest_backlog: int = SETTINGS["ingest_backlog"].default
    memory_trim_above: int = SETTINGS["memory_trim_above"].default
    stop_timeout: int = SETTINGS["stop_timeout"].default
    gc_interval: int = SETTINGS["gc_interval"].default
    gc_walk_interval: int = SETTINGS["gc_walk_interval"].default
    gc_compact_threshold: float = SETTINGS["gc_compact_threshold"].default
    durability: str = SETTINGS["durability"].default
    api_address: str = SETTINGS["api_address"].default
    api_token: str = SETTINGS["api_token"].default
    api_token_file: Path | None = SETTINGS["api_token_file"].default
    api_insecure_no_token: bool = SETTINGS["api_insecure_no_token"].default
    proxy_upstream: str = SETTINGS["proxy_upstream"].default
    proxy_listen: str = SETTINGS["proxy_listen"].default
    proxy_mount: Path | None = SETTINGS["proxy_mount"].default
    proxy_min_restore: int = SETTINGS["proxy_min_restore"].default
    proxy_max_body: int = SETTINGS["proxy_max_body"].default
    proxy_max_prompt_tokens: int = SETTINGS["proxy_max_prompt_tokens"].default
    proxy_tenant: str = SETTINGS["proxy_tenant"].default
    cache_max_bytes: int = SETTINGS["cache_max_bytes"].default
    remote: str = SETTINGS["remote"].default
    remote_endpoint: str = SETTINGS["remote_endpoint"].default
    remote_upload_workers: int = SETTINGS["remote_upload_workers"].default
    remote_fetch_workers: int = SETTINGS["remote_fetch_workers"].default
    remote_grace: int = SETTINGS["remote_grace"].default
    remote_pack_size: int = SETTINGS["remote_pack_size"].default
    remote_list_ttl: int = SETTINGS["remote_list_ttl"].default
    local_cache_size: int = SETTINGS["local_cache_size"].default
    score: str = SETTINGS["score"].default
    log_level: str = SETTINGS["log_level"].default
    sources: dict[str, str] = field(default_factory=lambda: dict.fromkeys(SETTINGS, "default"), compare=False)


_FIELDS = {f.name for f in fields(Config)} - {"sources"}
if _FIELDS != set(SETTINGS):  # a programming error: fail at import, in every test
    raise RuntimeError(f"Config and SETTINGS disagree: {sorted(_FIELDS ^ set(SETTINGS))}")


# --- loading --------------------------------------------------------------------------------------

Layer = dict[str, tuple[Any, str]]  # name -> (typed value, source)


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else str(value)


def _error(name: str, value: object, source: str, reason: str) -> ConfigError:
    return ConfigError(f"{name} = {_show(value)} ({source}): {reason}")


def _parse(setting: Setting, raw: object, source: str, base: Path | None) -> Any:
    """Typed value of ``raw`` or a ConfigError naming the key and source."""
    try:
        value = _convert(setting, raw, base)
    except ValueError as e:
        raise _error(setting.name, raw, source, str(e)) from None
    if setting.lo is not None and value < setting.lo:
        raise _error(setting.name, raw, source, f"must be at least {setting.lo}")
    if setting.hi is not None and value > setting.hi:
        raise _error(setting.name, raw, source, f"must be at most {setting.hi}")
    return value


def _convert(setting: Setting, raw: object, base: Path | None) -> Any:
    if setting.kind == "path":
        return _parse_path(raw, base)
    if setting.kind == "file":  # an optional path: empty means unset
        return None if isinstance(raw, str) and not raw.strip() else _parse_path(raw, base)
    if setting.kind == "choice":
        text = _parse_str(raw).strip().lower()
        if text not in setting.choices:
            raise ValueError(f"must be one of {', '.join(setting.choices)}")
        return text
    return _PARSERS[setting.kind](raw)


def _parse_path(raw: object, base: Path | None) -> Path:
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ValueError("not a path")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return Path(os.path.normpath(path))


def _file_layer(path: Path, source: str) -> Layer:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    for k in sorted(k for k in data if k in RETIRED):
        _retired(k, f"config file {path}")
    unknown = sorted(k for k in data if k not in SETTINGS and k not in RETIRED)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in config file {path}")
    return {k: (_parse(SETTINGS[k], v, source, path.parent), source) for k, v in data.items() if k in SETTINGS}


def _retired(name: str, where: str) -> None:
    log.warning("%s (%s) no longer has an effect and is ignored: %s", name, where,
                                        RETIRED[name])  # fmt: skip


def _env_layer(environ: Mapping[str, str]) -> Layer:
    layer: Layer = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in RETIRED and var == ENV_PREFIX + name.upper():
            _retired(name, f"env:{var}")
            continue
        if name not in SETTINGS or var != SETTINGS[name].env:
            raise ConfigError(f"unknown environment variable {var} (known: {', '.join(_env_names())})")
        source = f"env:{var}"
        layer[name] = (_parse(SETTINGS[name], raw, source, None), source)
    return layer


def _env_names() -> list[str]:
    return [CONFIG_ENV] + [s.env for s in SETTINGS.values()]


def _flag_layer(args: Mapping[str, Any]) -> Layer:
    layer: Layer = {}
    for name, setting in SETTINGS.items():
        raw = args.get(name)
        if raw is None:
            continue
        flag = setting.flag
        if setting.kind == "bool" and raw is False:
            flag = "--no-" + flag[2:]  # what BooleanOptionalAction's negative form stores
        source = f"flag:{flag}"
        layer[name] = (_parse(setting, raw, source, None), source)
    return layer


def _config_file(args: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[Path, str] | None:
    """The config file to read and its source label, or None."""
    explicit = args.get("config")
    where = "flag:--config"
    if explicit is None and environ.get(CONFIG_ENV):
        explicit, where = environ[CONFIG_ENV], f"env:{CONFIG_ENV}"
    if explicit is not None:
        path = Path(explicit).expanduser().absolute()
        if not path.is_file():
            raise ConfigError(f"config = {_show(str(explicit))} ({where}): file not found")
        return path, f"file:{path}"
    path = default_config_path(environ)
    return (path, f"file:{path}") if path.is_file() else None


def _as_mapping(args: argparse.Namespace | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        return vars(args)
    return args


def load(
    args: argparse.Namespace | dict | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Merge defaults, config file, environment and flags into a checked Config.

    ``args`` is a Namespace from a parser set up by :func:`add_arguments` or a dict keyed by setting
    name (plus ``config``); keys that are not settings are ignored, as are None values (unset flags).
    """
    environ = os.environ if environ is None else environ
    flags = _as_mapping(args)
    merged: Layer = {name: (s.default, "default") for name, s in SETTINGS.items()}
    merged["store"] = (_default_store(environ), "default")
    config_file = _config_file(flags, environ)
    if config_file is not None:
        merged.update(_file_layer(*config_file))
    merged.update(_env_layer(environ))
    merged.update(_flag_layer(flags))
    _check_consistency(merged)
    values = {name: value for name, (value, _) in merged.items()}
    return Config(**values, sources={name: source for name, (_, source) in merged.items()})


def _check_consistency(merged: Layer) -> None:
    """Cross-setting rules, reported with both values and their sources."""
    for small, big in (("chunk_min", "chunk_avg"), ("chunk_avg", "chunk_max")):
        if merged[small][0] >= merged[big][0]:
            raise ConfigError(f"{_describe_one(merged, small)} must be less than {_describe_one(merged, big)}")
    if merged["pack_size"][0] < merged["chunk_max"][0]:
        raise ConfigError(f"{_describe_one(merged, 'pack_size')} must be at least {_describe_one(merged, 'chunk_max')}")
    if merged["local_cache_size"][0] and not merged["remote"][0]:
        raise ConfigError(
            f"{_describe_one(merged, 'local_cache_size')} needs remote (s3://bucket/prefix): only chunks safely "
            "in the bucket are evicted"
        )
    if merged["api_token"][0] and merged["api_token_file"][0] is not None:
        raise ConfigError(
            f"api_token ({merged['api_token'][1]}) and {_describe_one(merged, 'api_token_file')} are both set; use one"
        )


def api_token(cfg: Config) -> str:
    """The API's bearer token: ``api_token``, or the first line of ``api_token_file``; "" if neither."""
    if cfg.api_token_file is None:
        return cfg.api_token
    where = f"api_token_file = {_show(str(cfg.api_token_file))} ({cfg.sources.get('api_token_file', 'default')})"
    try:
        with open(cfg.api_token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise ConfigError(f"{where}: the file holds no token")
    return token


def _describe_one(merged: Layer, name: str) -> str:
    value, source = merged[name]
    return f"{name} = {_show(value)} ({source})"


# --- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, skip: Iterable[str] = ()) -> None:
    """Add ``--config`` and one flag per setting (but the flags in ``skip``, which the caller
    defines itself); unset flags stay None so load() can tell."""
    parser.add_argument("--config", metavar="PATH", default=None, help=f"TOML config file (env {CONFIG_ENV})")
    for setting in SETTINGS.values():
        if setting.flag in skip:
            continue
        help_text = f"{setting.help} (default {_default_text(setting)}; env {setting.env})"
        if setting.kind == "bool":
            parser.add_argument(setting.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            metavar = setting.kind.upper() if setting.kind != "choice" else "{" + ",".join(setting.choices) + "}"
            parser.add_argument(setting.flag, metavar=metavar, default=None, help=help_text)


def _default_text(setting: Setting) -> str:
    if setting.name == "store":
        return "/var/lib/kv-chunk-fs as root, else ~/.local/share/kv-chunk-fs"
    # argparse %-formats help strings.
    return _format_value(setting, setting.default).replace("%", "%%") or '""'


# --- rendering ------------------------------------------------------------------------------------


def _format_value(setting: Setting, value: Any) -> str:
    if setting.kind == "size":
        return f"{format_size(value)} ({value})" if value >= KiB else str(value)
    if setting.kind == "duration":
        return f"{format_duration(value)} ({value})" if value >= 60 else str(value)
    if setting.kind == "bool":
        return "true" if value else "false"
    if value is None:
        return ""
    if setting.name == "api_token" and value:
        return "(set, hidden)"  # keep the secret out of logs and terminals
    return str(value)


def describe(cfg: Config) -> str:
    """A table of every setting: name, effective value, source."""
    rows = [("NAME", "VALUE", "SOURCE")]
    for f in fields(cfg):
        if f.name in SETTINGS:
            value = _format_value(SETTINGS[f.name], getattr(cfg, f.name))
            rows.append((f.name, value or '""', cfg.sources.get(f.name, "default")))
    name_w = max(len(r[0]) for r in rows)
    value_w = max(len(r[1]) for r in rows)
    return "\n".join(f"{n:<{name_w}}  {v:<{value_w}}  {s}".rstrip() for n, v, s in rows)
