"""Tests for settings loading, precedence, parsing and rendering."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvchunkfs import config
from kvchunkfs.config import (
    DEFAULT_SCORE,
    SETTINGS,
    Config,
    ConfigError,
    add_arguments,
    describe,
    format_duration,
    format_size,
    load,
    parse_duration,
    parse_size,
)


@pytest.fixture(autouse=True)
def not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_is_root", lambda: False)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment whose home has no config file."""
    return {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin"}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("mountpoint", nargs="?")
    return p


def test_defaults(env: dict[str, str], tmp_path: Path) -> None:
    cfg = load(None, env)
    assert cfg.store == tmp_path / "home" / ".local" / "share" / "kv-chunk-fs"
    assert (cfg.chunk_min, cfg.chunk_avg, cfg.chunk_max) == (16384, 65536, 262144)
    assert (cfg.pack_size, cfg.cache_size) == (64 << 20, 128 << 20)
    assert (cfg.prefetch_workers, cfg.kernel_readahead_kb, cfg.verify_reads) == (8, 4096, True)
    assert (cfg.gc_interval, cfg.gc_compact_threshold, cfg.durability) == (3600, 0.5, "close")
    assert (cfg.api_address, cfg.api_token, cfg.log_level) == ("", "", "info")
    assert cfg.score == DEFAULT_SCORE
    assert cfg.sources == dict.fromkeys(SETTINGS, "default")


def test_root_defaults(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    monkeypatch.setattr(config, "_is_root", lambda: True)
    assert load(None, env).store == Path("/var/lib/kv-chunk-fs")
    assert config.default_config_path(env) == Path("/etc/kv-chunk-fs/config.toml")


def test_xdg_dirs(env: dict[str, str], tmp_path: Path) -> None:
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    write(tmp_path / "cfg" / "kv-chunk-fs" / "config.toml", "chunk_avg = 131072\n")
    cfg = load(None, env)
    assert cfg.store == tmp_path / "data" / "kv-chunk-fs"
    assert cfg.chunk_avg == 131072


def test_dataclass_matches_settings_table(env: dict[str, str]) -> None:
    names = [f.name for f in dataclasses.fields(Config)]
    assert names == [*SETTINGS, "sources"]
    # Config() defaults agree with load()'s, so other modules can build one directly.
    loaded, direct = load(None, env), Config(store=load(None, env).store)
    assert loaded == direct
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.chunk_avg = 1  # type: ignore[misc]


def test_precedence_and_sources(env: dict[str, str], tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.toml",
        'chunk_min = "8KiB"\nchunk_avg = "32KiB"\nchunk_max = "128KiB"\nlog_level = "debug"\n',
    )
    env.update(KV_CHUNK_FS_CHUNK_AVG="48KiB", KV_CHUNK_FS_CHUNK_MAX="192KiB")
    cfg = load({"config": str(path), "chunk_max": "160KiB"}, env)
    assert (cfg.chunk_min, cfg.chunk_avg, cfg.chunk_max, cfg.log_level) == (8192, 49152, 163840, "debug")
    assert cfg.sources["chunk_min"] == f"file:{path}"
    assert cfg.sources["log_level"] == f"file:{path}"
    assert cfg.sources["chunk_avg"] == "env:KV_CHUNK_FS_CHUNK_AVG"
    assert cfg.sources["chunk_max"] == "flag:--chunk-max"
    assert cfg.sources["pack_size"] == "default"


def test_default_config_file_used_when_present(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "home" / ".config" / "kv-chunk-fs" / "config.toml", "prefetch_workers = 3\n")
    cfg = load(None, env)
    assert cfg.prefetch_workers == 3
    assert cfg.sources["prefetch_workers"] == f"file:{path}"


def test_config_from_env_var(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "e.toml", 'cache_size = "1GiB"\n')
    env["KV_CHUNK_FS_CONFIG"] = str(path)
    assert load(None, env).cache_size == 1 << 30
    # --config beats the environment variable.
    other = write(tmp_path / "f.toml", 'cache_size = "2GiB"\n')
    assert load({"config": str(other)}, env).cache_size == 2 << 30


def test_explicit_missing_config_is_an_error(env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config = .*nope\.toml.*\(flag:--config\): file not found"):
        load({"config": str(tmp_path / "nope.toml")}, env)
    env["KV_CHUNK_FS_CONFIG"] = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="env:KV_CHUNK_FS_CONFIG"):
        load(None, env)


def test_error_message_names_key_and_source(env: dict[str, str]) -> None:
    env["KV_CHUNK_FS_CHUNK_AVG"] = "abc"
    with pytest.raises(ConfigError) as e:
        load(None, env)
    assert str(e.value) == 'chunk_avg = "abc" (env:KV_CHUNK_FS_CHUNK_AVG): not a size'
    assert isinstance(e.value, ValueError)


def test_bad_file_values_name_the_file(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "prefetch_workers = 100\n")
    with pytest.raises(ConfigError) as e:
        load({"config": str(path)}, env)
    assert str(e.value) == f"prefetch_workers = 100 (file:{path}): must be at most 64"


def test_overridden_bad_value_still_fails(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", 'durability = "sometimes"\n')
    with pytest.raises(ConfigError, match="durability"):
        load({"config": str(path), "durability": "fsync"}, env)


def test_unknown_keys(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "chunk_avg = 65536\nchunk_size = 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) chunk_size in config file"):
        load({"config": str(path)}, env)
    nested = write(tmp_path / "n.toml", "[kv-chunk-fs]\nchunk_avg = 65536\n")
    with pytest.raises(ConfigError, match="kv-chunk-fs"):
        load({"config": str(nested)}, env)
    env["KV_CHUNK_FS_CHUNK_SIZE"] = "1"
    with pytest.raises(ConfigError, match="unknown environment variable KV_CHUNK_FS_CHUNK_SIZE"):
        load(None, env)


def test_a_retired_setting_is_read_with_one_warning(
    env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config file (or the environment) written for an older version that sets ``readahead``,
    which no longer does anything, still loads: one warning line names it; its flag is gone."""
    path = write(tmp_path / "r.toml", 'readahead = "16MiB"\nchunk_avg = 65536\n')
    with caplog.at_level("WARNING", logger="kvchunkfs.config"):
        cfg = load({"config": str(path)}, env)
    assert cfg.chunk_avg == 65536 and not hasattr(cfg, "readahead")
    lines = [r.getMessage() for r in caplog.records if "readahead" in r.getMessage()]
    assert len(lines) == 1 and "no longer has an effect" in lines[0], lines
    caplog.clear()
    env["KV_CHUNK_FS_READAHEAD"] = "8MiB"
    with caplog.at_level("WARNING", logger="kvchunkfs.config"):
        load(None, env)
    assert ["KV_CHUNK_FS_READAHEAD" in r.getMessage() for r in caplog.records] == [True]
    assert "readahead" not in SETTINGS


def test_retired_settings_are_ignored_with_one_warning(
    env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config file or the environment that still sets a setting without effect loads, saying so
    once; the command line no longer has its flag."""
    path = write(tmp_path / "c.toml", "writeback_cache = true\nchunk_avg = 65536\n")
    env["KV_CHUNK_FS_CHUNK_WORKERS"] = "4"
    with caplog.at_level("WARNING", logger="kvchunkfs.config"):
        cfg = load({"config": str(path)}, env)
    assert cfg.chunk_avg == 65536 and not hasattr(cfg, "writeback_cache")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("no longer has an effect" in x for x in lines), lines
    assert "writeback_cache" in lines[0] and "chunk_workers" in lines[1]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--writeback-cache"])


def test_env_names_are_upper_case(env: dict[str, str]) -> None:
    env["KV_CHUNK_FS_chunk_avg"] = "128KiB"
    with pytest.raises(ConfigError, match="unknown environment variable KV_CHUNK_FS_chunk_avg"):
        load(None, env)


def test_toml_syntax_error(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "chunk_avg = = 3\n")
    with pytest.raises(ConfigError, match=f"config file {path}"):
        load({"config": str(path)}, env)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (65536, 65536),
        ("65536", 65536),
        ("64KiB", 65536),
        ("64kib", 65536),
        ("64K", 65536),
        ("32MiB", 32 << 20),
        ("32 MiB", 32 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("500MB", 500_000_000),
        ("2kb", 2000),
        ("1TiB", 1 << 40),
        ("7B", 7),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "64XB", "-1KiB", "1.2.3MiB", "KiB", True, 1.5, None])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(3600, 3600), ("3600", 3600), ("1h", 3600), ("30m", 1800), ("10s", 10), ("1d", 86400), ("1h30m", 5400),
     ("0", 0), (" 2H ", 7200)],
)  # fmt: skip
def test_parse_duration(text: object, expected: int) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["1x", "h", "", "1.5h", "-1h", "1h 30m", False])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@given(n=st.integers(min_value=0, max_value=1 << 50))
def test_format_size_round_trips_exact_values(n: int) -> None:
    text = format_size(n)
    if "." not in text:
        assert parse_size(text.replace(" ", "")) == n


@given(n=st.integers(min_value=0, max_value=10**8))
def test_format_duration_round_trips(n: int) -> None:
    assert parse_duration(format_duration(n)) == n


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("1", True), ("yes", True), ("ON", True), ("false", False), ("0", False), ("no", False)],
)
def test_env_bools(env: dict[str, str], raw: str, expected: bool) -> None:
    env["KV_CHUNK_FS_VERIFY_READS"] = raw
    assert load(None, env).verify_reads is expected


def test_typed_values_from_env(env: dict[str, str]) -> None:
    env.update(
        KV_CHUNK_FS_GC_INTERVAL="30m",
        KV_CHUNK_FS_GC_COMPACT_THRESHOLD="0.25",
        KV_CHUNK_FS_DURABILITY="FSYNC",
        KV_CHUNK_FS_API_ADDRESS="127.0.0.1:8765",
        KV_CHUNK_FS_API_TOKEN="s3cret",
        KV_CHUNK_FS_SCORE="use_count / (1 + size)",
        KV_CHUNK_FS_LOG_LEVEL="warning",
        KV_CHUNK_FS_KERNEL_READAHEAD_KB="0",
    )
    cfg = load(None, env)
    assert (cfg.gc_interval, cfg.gc_compact_threshold, cfg.durability) == (1800, 0.25, "fsync")
    assert (cfg.api_address, cfg.api_token, cfg.score) == ("127.0.0.1:8765", "s3cret", "use_count / (1 + size)")
    assert (cfg.log_level, cfg.kernel_readahead_kb) == ("warning", 0)


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("VERIFY_READS", "maybe", "not a boolean"),
        ("PREFETCH_WORKERS", "0", "at least 1"),
        ("PREFETCH_WORKERS", "8.5", "not an integer"),
        ("GC_COMPACT_THRESHOLD", "1.5", "at most 1"),
        ("GC_COMPACT_THRESHOLD", "nan", "not a number"),
        ("GC_INTERVAL", "soon", "not a duration"),
        ("DURABILITY", "never", "one of close, fsync"),
        ("LOG_LEVEL", "trace", "one of debug"),
        ("API_ADDRESS", "localhost", "host:port"),
        ("API_ADDRESS", "localhost:99999", "host:port"),
        ("SCORE", "size + bogus", "unknown name 'bogus'"),
        ("CHUNK_MIN", "32", "at least 64"),
        ("CHUNK_MAX", "64MiB", "at most"),
        ("STORE", "  ", "not a path"),
    ],
)
def test_invalid_env_values(env: dict[str, str], name: str, raw: str, fragment: str) -> None:
    env["KV_CHUNK_FS_" + name] = raw
    with pytest.raises(ConfigError, match=rf"^{name.lower()} = .*\(env:KV_CHUNK_FS_{name}\): .*{fragment}"):
        load(None, env)


def test_chunk_order_is_checked(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        load({"chunk_min": "64KiB"}, env)
    assert str(e.value) == "chunk_min = 65536 (flag:--chunk-min) must be less than chunk_avg = 65536 (default)"
    env["KV_CHUNK_FS_CHUNK_MAX"] = "32KiB"
    with pytest.raises(ConfigError, match=r"chunk_avg = 65536 \(default\) must be less than chunk_max = 32768"):
        load(None, env)
    del env["KV_CHUNK_FS_CHUNK_MAX"]
    with pytest.raises(ConfigError, match=r"pack_size = 1024 \(flag:--pack-size\) must be at least chunk_max"):
        load({"pack_size": 1024}, env)


def test_local_cache_size_needs_a_remote(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"local_cache_size = 1073741824 \(flag:--local-cache-size\) needs remote"):
        load({"local_cache_size": "1GiB"}, env)
    cfg = load({"local_cache_size": "1GiB", "remote": "s3://bucket/prefix"}, env)
    assert cfg.local_cache_size == 1 << 30
    assert load(None, env).local_cache_size == 0  # the default: never evict


def test_chunk_sizes_need_not_be_powers_of_two(env: dict[str, str]) -> None:
    cfg = load({"chunk_min": 1000, "chunk_avg": 3000, "chunk_max": 10000}, env)
    assert (cfg.chunk_min, cfg.chunk_avg, cfg.chunk_max) == (1000, 3000, 10000)


def test_store_paths(env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "etc" / "c.toml", 'store = "data/store"\n')
    assert load({"config": str(path)}, env).store == tmp_path / "etc" / "data" / "store"
    monkeypatch.chdir(tmp_path)
    env["KV_CHUNK_FS_STORE"] = "rel"
    assert load(None, env).store == tmp_path / "rel"
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert load({"store": "~/s"}, env).store == tmp_path / "h" / "s"


def test_argparse_flags(env: dict[str, str]) -> None:
    p = parser()
    ns = p.parse_args(
        ["--chunk-avg", "128KiB", "--chunk-max", "1MiB", "--no-verify-reads", "--gc-interval", "2h", "/mnt"]
    )
    cfg = load(ns, env)
    assert (cfg.chunk_avg, cfg.chunk_max, cfg.verify_reads, cfg.gc_interval) == (131072, 1 << 20, False, 7200)
    assert cfg.sources["verify_reads"] == "flag:--no-verify-reads"
    assert cfg.sources["gc_interval"] == "flag:--gc-interval"
    assert cfg.sources["store"] == "default"
    assert load(p.parse_args(["--verify-reads"]), env).sources["verify_reads"] == "flag:--verify-reads"


def test_unset_flags_are_none() -> None:
    ns = parser().parse_args([])
    assert ns.config is None
    assert all(getattr(ns, name) is None for name in SETTINGS)


def test_every_setting_has_a_flag_and_help_renders() -> None:
    text = parser().format_help()
    for setting in SETTINGS.values():
        assert setting.flag in text
        assert setting.env in text


def test_describe(env: dict[str, str]) -> None:
    env.update(KV_CHUNK_FS_API_TOKEN="s3cret", KV_CHUNK_FS_PACK_SIZE="500MB")
    text = describe(load(None, env))
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "VALUE", "SOURCE"]
    assert len(lines) == 1 + len(SETTINGS)
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["chunk_avg"].split() == ["chunk_avg", "64", "KiB", "(65536)", "default"]
    assert rows["pack_size"].split() == ["pack_size", "476.8", "MiB", "(500000000)", "env:KV_CHUNK_FS_PACK_SIZE"]
    assert rows["gc_interval"].split() == ["gc_interval", "1h", "(3600)", "default"]
    assert rows["verify_reads"].split() == ["verify_reads", "true", "default"]
    assert rows["api_address"].split() == ["api_address", '""', "default"]
    assert "s3cret" not in text
    assert "hidden" in rows["api_token"]


def test_store_settings_defaults_are_the_tables():
    """The store layer cannot import config (a higher layer); its defaults must still agree."""
    import dataclasses

    from kvchunkfs.store.repository import StoreSettings

    for f in dataclasses.fields(StoreSettings):
        assert f.default == config.SETTINGS[f.name].default, f.name
    assert StoreSettings.from_config(config.Config()) == StoreSettings()


@pytest.mark.parametrize(
    ("raw", "value"), [("none", "none"), ("API-Key", "api-key"), ("header:X-User", "header:x-user")]
)
def test_proxy_tenant_values(env: dict[str, str], raw: str, value: str) -> None:
    assert load({"proxy_tenant": raw}, environ=env).proxy_tenant == value
    assert load(None, environ={**env, "KV_CHUNK_FS_PROXY_TENANT": raw}).proxy_tenant == value


@pytest.mark.parametrize("raw", ["", "user", "header:", "header:X User", "api-key:x"])
def test_proxy_tenant_rejects_what_it_cannot_mean(env: dict[str, str], raw: str) -> None:
    with pytest.raises(ConfigError, match="proxy_tenant .*none, api-key or header:NAME"):
        load({"proxy_tenant": raw}, environ=env)
