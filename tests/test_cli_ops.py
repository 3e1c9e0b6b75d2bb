"""The command line: `config` provenance and errors, every subcommand's wiring, `ls`/`stats`/`tree`."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, write_in_pieces

from kvchunkfs.cli import main as cli
from kvchunkfs.format import index as idx

MiB = 1 << 20


def run(*args: str, env: dict[str, str] | None = None, config: Path | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, with a clean KV_CHUNK_FS_* environment."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    full_env["PYTHONPATH"] = str(SRC)
    if config is not None:
        full_env["KV_CHUNK_FS_CONFIG"] = str(config)  # never the machine's own config file
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "kvchunkfs.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=120)


def config_rows(stdout: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in stdout.splitlines()[1:]:
        if line.strip():
            name, value, source = re.split(r"\s{2,}", line.strip())
            rows[name] = (value, source)
    return rows


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


# -- config ----------------------------------------------------------------------------------------


def test_config_shows_each_value_and_where_it_came_from(tmp_path: Path) -> None:
    conf = tmp_path / "conf.toml"
    conf.write_text('chunk_avg = "128KiB"\npack_size = "16MiB"\ngc_interval = "2h"\nstore = "data"\n')
    env = {"KV_CHUNK_FS_CACHE_SIZE": "1GiB", "KV_CHUNK_FS_PACK_SIZE": "8MiB"}
    r = run("config", "--pack-size", "4MiB", "--api-address", "9000", "--api-token", "s3cret", env=env, config=conf)
    assert r.returncode == 0, r.stderr
    rows = config_rows(r.stdout)
    file_source = f"file:{conf}"
    assert rows["chunk_avg"] == ("128 KiB (131072)", file_source)
    assert rows["gc_interval"] == ("2h (7200)", file_source)
    assert rows["store"] == (str(tmp_path / "data"), file_source), "relative to the config file"
    assert rows["cache_size"] == ("1 GiB (1073741824)", "env:KV_CHUNK_FS_CACHE_SIZE")
    assert rows["pack_size"] == ("4 MiB (4194304)", "flag:--pack-size"), "flag beats env beats file"
    assert rows["api_address"] == ("127.0.0.1:9000", "flag:--api-address"), "a bare port is loopback"
    assert rows["api_token"] == ("(set, hidden)", "flag:--api-token")
    assert "s3cret" not in r.stdout
    assert rows["chunk_min"] == ("16 KiB (16384)", "default")
    assert set(rows) >= {"score", "durability", "log_level", "verify_reads"}
    # --config on the command line names the file too.
    r = run("config", "--config", str(conf), config=tmp_path / "does-not-matter.toml")
    assert r.returncode == 0, r.stderr
    assert config_rows(r.stdout)["chunk_avg"][1] == file_source


@pytest.mark.parametrize(
    ("args", "env", "toml", "message"),
    [
        ((), {}, "bogus = 1\n", "unknown setting(s) bogus in config file"),
        ((), {"KV_CHUNK_FS_BOGUS": "1"}, "", "unknown environment variable KV_CHUNK_FS_BOGUS"),
        ((), {}, 'chunk_avg = "lots"\n', 'chunk_avg = "lots" (file:'),
        ((), {}, "chunk_avg = [", "config file"),
        ((), {"KV_CHUNK_FS_PREFETCH_WORKERS": "0"}, "", "(env:KV_CHUNK_FS_PREFETCH_WORKERS): must be at least 1"),
        (("--durability", "sometimes"), {}, "", "(flag:--durability): must be one of close, fsync"),
        (("--score", "__import__('os')"), {}, "", "bad score formula"),
        (("--api-address", "nowhere"), {}, "", "not host:port"),
        (("--chunk-min", "1MiB"), {}, "", "chunk_min = 1048576 (flag:--chunk-min) must be less than chunk_avg"),
    ],
)
def test_config_errors_are_clear(tmp_path: Path, args: tuple, env: dict, toml: str, message: str) -> None:
    conf = tmp_path / "conf.toml"
    conf.write_text(toml)
    r = run("config", *args, env=env, config=conf)
    assert r.returncode == 2
    assert "configuration error" in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_unknown_flag_and_missing_config_file(tmp_path: Path, empty_config: Path) -> None:
    r = run("config", "--bogus", "1", config=empty_config)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr
    r = run("config", "--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "file not found" in r.stderr and "Traceback" not in r.stderr


def _positionals(parser) -> list[str]:  # noqa: ANN001 - argparse internals
    return [a.dest for a in parser._actions if not a.option_strings and a.required and a.nargs is None]


def test_every_subcommand_takes_the_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            empty_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("KV_CHUNK_FS_CONFIG", str(empty_config))
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert {"mount", "config", "export-store", "ls", "stats", "tree", "gc"} <= set(subparsers)
    for name, sub in subparsers.items():
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        help_text = capsys.readouterr().out
        for flag in ("--config", "--store", "--chunk-avg", "--api-address", "--score"):
            assert flag in help_text, (name, flag)
        # Settings are loaded and checked before the command does anything.
        dummies = [str(tmp_path / d) for d in _positionals(sub)]
        assert cli.main([name, *dummies, "--chunk-avg", "lots"]) == 2, name
        assert "chunk_avg" in capsys.readouterr().err
        assert not any(Path(d).exists() for d in dummies), f"{name} acted despite a bad setting"


# -- ls, stats, tree -------------------------------------------------------------------------------


def ggsq(tokens: list[int], tail: bytes) -> bytes:
    return struct.pack("<3I", 0x67677371, 4, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + tail


def fill(kvfs) -> dict[str, bytes]:  # noqa: ANN001 - the conftest Mount
    kv = rand_bytes(5 * MiB, 50)
    files = {
        "one": ggsq(list(range(20_000)) + [1, 2], kv),
        "two": ggsq(list(range(20_000)) + [3], kv[: 4 * MiB] + rand_bytes(MiB, 51)),
        "solo": rand_bytes(2 * MiB, 52),
    }
    for name, data in files.items():
        write_in_pieces(kvfs.path(name), data, MiB)
    kvfs.ingested()  # the stubs and the packs hold the saves once ingestion has stored them
    os.setxattr(kvfs.path("one"), "user.kvcfs.label.model", b"qwen")
    kvfs.path("two").read_bytes()
    return files


def expected_share(snapshots: Path) -> dict[str, tuple[int, int]]:
    chunks = {}
    for p in snapshots.iterdir():
        index = idx.decode(p.read_bytes())
        chunks[p.name] = {cid: index.ends[i] - (index.ends[i - 1] if i else 0) for i, cid in enumerate(index.ids)}
    refs = Counter(cid for c in chunks.values() for cid in c)
    return {
        name: (sum(n for cid, n in c.items() if refs[cid] == 1), sum(n for cid, n in c.items() if refs[cid] > 1))
        for name, c in chunks.items()
    }


def test_ls_stats_tree_through_the_daemon_and_directly(kvfs, empty_config: Path) -> None:
    files = fill(kvfs)
    store = ["--store", str(kvfs.store)]

    def cli_json(*args: str) -> object:
        r = run(*args, *store, "--json", config=empty_config)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    share = expected_share(kvfs.store / "snapshots")
    live_rows = cli_json("ls")
    assert {r["path"]: (r["unique_bytes"], r["shared_bytes"]) for r in live_rows} == share
    assert share["one"][1] > 3 * MiB and share["solo"] == (2 * MiB, 0)
    assert {r["path"]: r["use_count"] for r in live_rows} == {"one": 0, "two": 1, "solo": 0}
    live_stats = cli_json("stats")
    assert "counters" in live_stats, "answered by the daemon, with its live counters"
    table = run("ls", *store, "--sort", "size", "-r", config=empty_config)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:5] == ["PATH", "SIZE", "UNIQUE", "SHARED", "USES"]
    assert [line.split()[0] for line in lines[1:]] == ["one", "two", "solo"]
    assert "model=qwen" in lines[1] and "2MiB" in lines[3]
    dash = run("ls", *store, "--sort=-size", config=empty_config).stdout
    assert [line.split()[0] for line in dash.splitlines()] == [line.split()[0] for line in lines]
    only = run("ls", *store, "--filter", "label.model=qwen", config=empty_config)
    assert [line.split()[0] for line in only.stdout.splitlines()[1:]] == ["one"]
    live_tree = run("tree", *store, config=empty_config)
    assert live_tree.returncode == 0, live_tree.stderr
    assert "20000 tokens shared by one, two" in live_tree.stdout and "skipped solo" in live_tree.stdout
    stats_text = run("stats", *store, config=empty_config).stdout
    assert re.search(r"snapshots:\s+3\n", stats_text) and "dedup ratio:" in stats_text
    for bad, message in ((("--sort", "bogus"), "unknown field"), (("--filter", "nonsense"), "KEY=VALUE"),
                         (("--filter", "min_size=huge"), "min_size")):  # fmt: skip
        r = run("ls", *store, *bad, config=empty_config)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    kvfs.stop()
    assert not (kvfs.store / "api.sock").exists()
    # No daemon: the same answers from the store directory.
    offline_rows = cli_json("ls")
    strip = ("score", "age_hours", "idle_hours")
    assert [{k: v for k, v in r.items() if k not in strip} for r in offline_rows] == [
        {k: v for k, v in r.items() if k not in strip} for r in live_rows
    ]
    offline_stats = cli_json("stats")
    assert "counters" not in offline_stats
    for key in ("snapshots", "logical_bytes", "referenced_bytes", "stored_bytes", "chunks", "packs"):
        assert offline_stats[key] == live_stats[key], key
    assert offline_stats["logical_bytes"] == sum(len(d) for d in files.values())
    assert run("tree", *store, config=empty_config).stdout == live_tree.stdout
    r = run("ls", *store, "--sort", "bogus", config=empty_config)
    assert r.returncode == 2 and "unknown field" in r.stderr


def test_gc_through_the_daemon_socket(kvfs, empty_config: Path) -> None:
    fill(kvfs)
    os.unlink(kvfs.path("solo"))
    r = run("gc", "--store", str(kvfs.store), "--json", config=empty_config)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_freed"] == 2 * MiB
    assert "API deleted" not in kvfs.log()


def test_inspecting_a_missing_store_is_a_clear_error(tmp_path: Path, empty_config: Path) -> None:
    for command in ("ls", "stats", "tree"):
        r = run(command, "--store", str(tmp_path / "nothing"), config=empty_config)
        assert r.returncode == 2 and "no store at" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "nothing").exists(), "inspecting must not create a store"


def test_stats_and_metrics_tell_how_the_files_bytes_travel(tmp_path: Path, empty_config: Path) -> None:
    """The FUSE mode (passthrough where the kernel and the daemon allow it, else served) and why:
    the mount's log line, `kv-chunk-fs stats` and the kvcfs_fuse_passthrough metric agree."""
    store = ["--store", str(tmp_path / "store")]
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    for extra, forced in ((["--no-fuse-passthrough"], True), ([], False)):
        m.start(extra)
        try:
            live = run("stats", *store, "--json", config=empty_config)
            fuse = json.loads(live.stdout)["fuse"]
            logged = re.findall(r"FUSE 7\.\d+, (\w+) mode: (.*)", m.log())[-1]
            assert (fuse["mode"], fuse["why"]) == logged
            if forced:
                assert fuse == {"mode": "served", "why": "passthrough is turned off (fuse_passthrough = false)"}
            elif tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 9) and "does not offer" not in fuse["why"]:
                assert fuse["mode"] == "passthrough", fuse  # root, Linux 6.9+: nothing stands in its way
            text = run("stats", *store, config=empty_config).stdout
            assert re.search(rf"fuse mode:\s+{re.escape(fuse['mode'])} \({re.escape(fuse['why'])}\)", text), text
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(m.store / "api.sock"))) as api:
                metrics = api.get("http://daemon/metrics").text
            assert f"kvcfs_fuse_passthrough {float(fuse['mode'] == 'passthrough')}" in metrics
        finally:
            m.stop()
