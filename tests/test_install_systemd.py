"""``install-systemd`` writes what it was given: the generated unit and drop-in are read as systemd
reads them (the unit's lines, then the drop-in's, a later ``Environment`` assignment of a variable
winning), and the ``ExecStart`` line is started with that environment and nothing else of the
caller's: it must serve the store and use the settings the command was given.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import SRC, WHOLE_ROOT, is_mounted, remove_whole_files

from kvchunkfs.service.apiclient import DaemonClient

CLI = [sys.executable, "-m", "kvchunkfs.cli"]


def _install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    return subprocess.run([*CLI, "install-systemd", *args], env={**base, "PYTHONPATH": str(SRC), **(env or {})},
                          capture_output=True, text=True)  # fmt: skip


def _service_lines(*files: Path) -> list[tuple[str, str]]:
    """The [Service] lines of a unit and its drop-ins, in the order systemd applies them."""
    out = []
    for path in files:
        section = ""
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("[") and line.endswith("]"):
                section = line
            elif section == "[Service]" and line and not line.startswith(("#", ";")):
                key, _, value = line.partition("=")
                out.append((key, value))
    return out


def as_systemd_reads(unit_dir: Path, name: str = "kv-chunk-fs.service") -> tuple[dict[str, str], dict[str, str]]:
    """(the service's environment, its other settings: the last value of each key)."""
    lines = _service_lines(unit_dir / name, unit_dir / f"{name}.d" / "settings.conf")
    env: dict[str, str] = {}
    other: dict[str, str] = {}
    for key, value in lines:
        if key == "Environment":
            for word in shlex.split(value):  # systemd's quoting: "A=b c" is one assignment
                var, _, val = word.partition("=")
                env[var] = val.replace("%%", "%")
        else:
            other[key] = value
    return env, other


def _expand(line: str, env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word) for word in line.split()]


def test_the_unit_serves_the_store_it_was_given(tmp_path: Path) -> None:
    store, mnt, units = tmp_path / "nc-store", tmp_path / "slots", tmp_path / "units"
    token = tmp_path / "api-token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    WHOLE_ROOT.mkdir(mode=0o700, exist_ok=True)
    whole = WHOLE_ROOT / uuid.uuid4().hex
    exe = f"{sys.executable} -m kvchunkfs.cli"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _install("--unit-dir", str(units), "--mountpoint", str(mnt), "--exe", exe, "--store", str(store),
                 "--hot-tier-size", "1GiB", "--stop-timeout", "120", "--api-address", f"127.0.0.1:{port}",
                 "--api-token-file", str(token), "--whole-files-dir", str(whole),
                 env={"KV_CHUNK_FS_SCORE": "(1 + use_count) / (1 + idle_hours)"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    env, other = as_systemd_reads(units)
    assert env["KV_CHUNK_FS_STORE"] == str(store)
    assert env["KV_CHUNK_FS_STOP_TIMEOUT"] == "120", "the daemon's own wait, not only systemd's"
    assert other["TimeoutStopSec"] == "6min"
    assert env["KV_CHUNK_FS_SCORE"] == "(1 + use_count) / (1 + idle_hours)", "from the environment, quoted"
    assert env["KVCFS_MOUNTPOINT"] == str(mnt)

    # What the daemon will use, asked with the unit's environment alone.
    clean = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(SRC), **env}
    shown = subprocess.run([*CLI, "config"], env=clean, capture_output=True, text=True, check=True).stdout
    expected = {"hot_tier_size": "(1073741824)", "stop_timeout": "(120)", "api_token_file": str(token),
                "api_address": f"127.0.0.1:{port}", "store": str(store), "whole_files_dir": str(whole)}  # fmt: skip
    for name, value in expected.items():
        row = next(line for line in shown.splitlines() if line.startswith(name + " "))
        assert value in row and "env:" in row, row

    for key in ("ExecStartPre", "ExecStart"):
        assert key in other
    subprocess.run(_expand(other["ExecStartPre"].lstrip("-"), env), check=True)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_expand(other["ExecStart"], env), env=clean, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not is_mounted(mnt):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        (mnt / "slot0.bin").write_bytes(os.urandom(300_000))
        assert (store / "snapshots" / "slot0.bin").exists(), "the save went into the store given"
        stats = DaemonClient(store).json("GET", "/stats")  # the daemon answers on the given store's socket
        assert stats["snapshots"] == 1
        assert json.loads(os.getxattr(mnt, "user.kvcfs.stats"))["hot_budget"] == 1 << 30
        req = urllib.request.Request(f"http://127.0.0.1:{port}/stats", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=30) as answer:  # the API on the address and token given
            assert json.load(answer)["snapshots"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)  # systemctl stop
        assert proc.wait(timeout=60) == 0, log.read_text()
        remove_whole_files(whole)
    assert not is_mounted(mnt)


def test_settings_a_unit_cannot_carry_are_refused_by_name(tmp_path: Path) -> None:
    r = _install("--unit-dir", str(tmp_path), "--api-token", "s3cret", "--proxy-upstream", "http://10.0.0.1:8080")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "api_token" in r.stderr and "--api-token-file" in r.stderr
    assert "proxy_upstream" in r.stderr and "--proxy" in r.stderr
    assert not (tmp_path / "kv-chunk-fs.service").exists(), "nothing written when something is refused"


def test_an_existing_dropin_keeps_its_lines_and_gets_the_given_ones(tmp_path: Path) -> None:
    dropin = tmp_path / "kv-chunk-fs.service.d" / "settings.conf"
    dropin.parent.mkdir(parents=True)
    dropin.write_text("[Service]\n# mine\nEnvironment=KV_CHUNK_FS_STORE=/old\nEnvironment=KV_CHUNK_FS_GC_INTERVAL=60\n")
    assert _install("--unit-dir", str(tmp_path), "--store", "/srv/new").returncode == 0
    env, _ = as_systemd_reads(tmp_path)
    assert env["KV_CHUNK_FS_STORE"] == "/srv/new"
    assert env["KV_CHUNK_FS_GC_INTERVAL"] == "60"
    assert "# mine" in dropin.read_text()
    assert dropin.read_text().count("KV_CHUNK_FS_STORE") == 1


def test_the_proxy_unit_gets_the_proxys_settings_and_the_store(tmp_path: Path) -> None:
    r = _install("--unit-dir", str(tmp_path), "--proxy", "--store", "/srv/s", "--proxy-upstream", "http://h:8080",
                 "--hot-tier-size", "2GiB")  # fmt: skip
    assert r.returncode == 0, r.stderr
    env, _ = as_systemd_reads(tmp_path, "kv-chunk-fs-proxy.service")
    assert env["KV_CHUNK_FS_STORE"] == "/srv/s" and env["KV_CHUNK_FS_PROXY_UPSTREAM"] == "http://h:8080"
    assert "KV_CHUNK_FS_HOT_TIER_SIZE" not in env
    mount_env, _ = as_systemd_reads(tmp_path)
    assert mount_env["KV_CHUNK_FS_HOT_TIER_SIZE"] == str(2 << 30) and "KV_CHUNK_FS_PROXY_UPSTREAM" not in mount_env


@pytest.mark.parametrize("flag", ["--config"])
def test_a_config_file_is_named_in_the_dropin(tmp_path: Path, flag: str) -> None:
    conf = tmp_path / "kv.toml"
    conf.write_text('store = "/srv/from-file"\n')
    assert _install("--unit-dir", str(tmp_path / "u"), flag, str(conf)).returncode == 0
    env, _ = as_systemd_reads(tmp_path / "u")
    assert env["KV_CHUNK_FS_CONFIG"] == str(conf)
