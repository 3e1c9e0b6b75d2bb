"""Deployment: systemd readiness (sd_notify) against a real mount, the unit files, the Grafana dashboard,
the setup scripts (what they ask apt for, with apt stubbed).

There is no running systemd here (PID 1 is not systemd in CI containers), so the readiness test plays
systemd's part: it binds the unix datagram socket named by NOTIFY_SOCKET and checks that READY=1
arrives, and only once the mount answers, and STOPPING=1 on SIGTERM, after which the daemon unmounts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SRC, Mount, is_mounted
from prometheus_client.parser import text_string_to_metric_families
from test_llama_shaped import SPEC, SYSTEM, proxy_save

from kvchunkfs.cli import systemd
from kvchunkfs.fuse import sdnotify
from kvchunkfs.service.apiclient import DaemonClient

ROOT = Path(__file__).resolve().parent.parent


def _notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    return sock


def test_ready_only_once_the_mount_is_up_and_stopping_on_sigterm(tmp_path: Path, monkeypatch) -> None:
    sock = _notify_socket(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", jitter=False)
    mount.start()  # returns once the mount is listed, which may be before READY: read on
    try:
        message = sock.recv(4096).decode()
        # The first message is READY, sent after a statvfs through the mount was answered.
        assert message.startswith("READY=1\n"), message
        assert is_mounted(mount.mnt)
        assert "mounted " in mount.log()  # logged right after the mount, before serving
        assert mount.proc is not None and f"MAINPID={mount.proc.pid}" in message
        os.statvfs(mount.mnt)
        mount.proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends (KillSignal=SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert mount.proc.wait(timeout=30) == 0
        assert not is_mounted(mount.mnt), "stop must unmount"
    finally:
        sock.close()
        mount.stop()


def test_ready_follows_the_mount_and_the_mount_works(tmp_path: Path, monkeypatch) -> None:
    """READY comes from a statvfs answered by the FUSE loop (until its session answers INIT, the kernel holds
    that request): it follows the "mounted" log line, and a save through the mount works right away."""
    sock = _notify_socket(tmp_path / "n.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
    env = dict(os.environ, PYTHONPATH=str(SRC))
    (tmp_path / "mnt").mkdir()
    log = tmp_path / "d.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(tmp_path / "store"),
                                 str(tmp_path / "mnt")], stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        assert sock.recv(4096).startswith(b"READY=1")
        assert "mounted " in log.read_text()
        with open(tmp_path / "mnt" / "probe", "wb") as f:  # and the mount works at once
            f.write(b"x" * 1000)
        assert (tmp_path / "mnt" / "probe").read_bytes() == b"x" * 1000
    finally:
        subprocess.run(["fusermount3", "-u", str(tmp_path / "mnt")], check=False, capture_output=True)
        proc.wait(timeout=30)
        sock.close()


def test_notify_without_socket_does_nothing(monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/socket")
    assert sdnotify.notify("READY=1") is False  # logged, never raised


def test_notify_abstract_socket(monkeypatch) -> None:
    name = f"kvcfs-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1")
        assert sock.recv(100) == b"READY=1"


# -- unit files --------------------------------------------------------------------------------------


def test_committed_unit_files_are_what_install_writes(tmp_path: Path) -> None:
    unit = ROOT / "deploy/systemd/kv-chunk-fs.service"
    assert unit.read_text() == systemd.render_unit("/usr/local/bin/kv-chunk-fs")
    dropin = ROOT / "deploy/systemd/kv-chunk-fs.service.d/settings.conf"
    assert dropin.read_text() == systemd.render_dropin()
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "install-systemd", "--unit-dir", str(tmp_path), "--mountpoint",
           "/srv/x", "--exe", "/opt/kvcfs/bin/kv-chunk-fs"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    unit = (tmp_path / "kv-chunk-fs.service").read_text()
    assert "Type=notify" in unit and "Restart=on-failure" in unit and "KillSignal=SIGTERM" in unit
    assert "ExecStart=/opt/kvcfs/bin/kv-chunk-fs mount ${KVCFS_MOUNTPOINT}" in unit
    (tmp_path / "kv-chunk-fs.service.d/settings.conf").write_text("[Service]\n# mine\n")
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    kept = (tmp_path / "kv-chunk-fs.service.d/settings.conf").read_text()
    assert kept.startswith("[Service]\n# mine\n") and "\nEnvironment=KVCFS_MOUNTPOINT=/srv/x\n" in kept


def test_install_systemd_names_the_command_that_runs(tmp_path: Path) -> None:
    """ExecStart is the kv-chunk-fs that was run (the /usr/local/bin symlink setup.sh makes), even with
    another kv-chunk-fs first on PATH."""
    bindir, decoy = tmp_path / "bin", tmp_path / "decoy"
    bindir.mkdir()
    decoy.mkdir()
    exe = bindir / "kv-chunk-fs"  # what pip writes for the console script
    exe.write_text(f"#!{sys.executable}\nimport sys\nfrom kvchunkfs.cli.main import main\nsys.exit(main())\n")
    (decoy / "kv-chunk-fs").write_text("#!/bin/sh\nexit 1\n")
    for path in (exe, decoy / "kv-chunk-fs"):
        path.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(SRC), PATH=f"{decoy}:{os.environ['PATH']}")
    subprocess.run([str(exe), "install-systemd", "--unit-dir", str(tmp_path / "units")], env=env, check=True,
                   capture_output=True)  # fmt: skip
    unit = (tmp_path / "units" / "kv-chunk-fs.service").read_text()
    assert f"\nExecStart={exe} mount ${{KVCFS_MOUNTPOINT}}\n" in unit


def _timeout_stop(unit: str) -> int:
    (line,) = [x for x in unit.splitlines() if x.startswith("TimeoutStopSec=")]
    value = line.partition("=")[2]
    return int(value[:-3]) * 60 if value.endswith("min") else int(value.rstrip("s"))


def test_systemd_waits_longer_than_the_stop(tmp_path: Path) -> None:
    """systemd kills the daemon at TimeoutStopSec: it must outlast the wait for the saves in flight
    (``stop_timeout``) with time left to unmount and close the store, the default and a longer one."""
    assert _timeout_stop(systemd.render_unit("kv-chunk-fs")) >= systemd.DEFAULT_STOP_TIMEOUT + 60
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "install-systemd", "--unit-dir", str(tmp_path), "--exe", "kvcfs",
           "--stop-timeout", "15m"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    assert _timeout_stop((tmp_path / "kv-chunk-fs.service").read_text()) >= 15 * 60 + 60
    assert "KV_CHUNK_FS_STOP_TIMEOUT=900" in (tmp_path / "kv-chunk-fs.service.d/settings.conf").read_text()


def test_install_systemd_proxy_writes_the_proxys_unit_after_the_mount_and_llama_server(tmp_path: Path) -> None:
    unit = ROOT / "deploy/systemd/kv-chunk-fs-proxy.service"
    assert unit.read_text() == systemd.render_proxy_unit("/usr/local/bin/kv-chunk-fs")
    dropin = ROOT / "deploy/systemd/kv-chunk-fs-proxy.service.d/settings.conf"
    assert dropin.read_text() == systemd.render_proxy_dropin()
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "install-systemd", "--proxy", "--unit-dir", str(tmp_path),
           "--mountpoint", "/srv/x", "--exe", "/opt/kvcfs/bin/kv-chunk-fs"]  # fmt: skip
    r = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    assert "enable --now kv-chunk-fs kv-chunk-fs-proxy" in r.stdout
    assert (tmp_path / "kv-chunk-fs.service").exists(), "the mount's unit too"
    text = (tmp_path / "kv-chunk-fs-proxy.service").read_text()
    unit_section = text[text.index("[Unit]") : text.index("[Service]")]
    assert re.search(r"^After=.*\bkv-chunk-fs\.service\b", unit_section, re.M)
    assert re.search(r"^After=.*\bllama-server\.service\b", unit_section, re.M)
    assert "Wants=kv-chunk-fs.service" in unit_section
    assert "Environment=KVCFS_MOUNTPOINT=/srv/x" in text
    assert "ExecStart=/opt/kvcfs/bin/kv-chunk-fs proxy --mount ${KVCFS_MOUNTPOINT}" in text
    (tmp_path / "kv-chunk-fs-proxy.service.d/settings.conf").write_text("[Service]\n# mine\n")
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    assert (tmp_path / "kv-chunk-fs-proxy.service.d/settings.conf").read_text().startswith("[Service]\n# mine\n")
    plain = tmp_path / "plain"
    subprocess.run([*cmd[:4], "--unit-dir", str(plain), *cmd[7:]], env=env, check=True, capture_output=True)
    assert not (plain / "kv-chunk-fs-proxy.service").exists(), "only with --proxy"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_proxy_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    systemd.install(tmp_path, f"{sys.executable} -m kvchunkfs.cli", "/srv/kv-slots")
    systemd.install_proxy(tmp_path, f"{sys.executable} -m kvchunkfs.cli", "/srv/kv-slots")
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kv-chunk-fs-proxy.service")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "kv-chunk-fs-proxy.service" not in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    systemd.install(tmp_path, f"{sys.executable} -m kvchunkfs.cli", "/srv/kv-slots")
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kv-chunk-fs.service")], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "kv-chunk-fs.service" not in r.stderr, r.stderr  # no warning about our unit


# -- Grafana -----------------------------------------------------------------------------------------


def dashboard_metrics() -> set[str]:
    board = json.loads((ROOT / "deploy/grafana/kv-chunk-fs.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs.append(board["templating"]["list"][1]["query"])
    names = {n for e in exprs for n in re.findall(r"\b(kvcfs_[a-z_]+)", e)}
    assert names, "no metric found in the dashboard"
    return names


def test_every_grafana_metric_exists_in_metrics(kvfs: Mount) -> None:
    proxy_save(kvfs.mnt, "conv", SYSTEM, SPEC)
    with open(kvfs.mnt / "conv", "rb") as f:  # a restore: its histogram gets a sample
        f.read()
    text = DaemonClient(kvfs.store).text("GET", "/metrics")
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    missing = sorted(dashboard_metrics() - samples)
    assert not missing, f"the Grafana dashboard queries metrics /metrics does not have: {missing}"


# -- setup scripts -----------------------------------------------------------------------------------

TEST_ONLY = {"chromium", "chromium-driver", "casync", "attr", "make"}


def _stub(path: Path, text: str) -> None:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)


def _setup_env(tmp_path: Path) -> dict[str, str]:
    """Where dpkg reports every package missing and apt-get records what it is asked to install and then
    fails, which stops a setup script there: nothing gets installed."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub(stubs / "dpkg-query", "exit 1\n")
    _stub(stubs / "dpkg", "exit 1\n")
    _stub(stubs / "apt-get", f'echo "$@" >> {tmp_path / "apt.log"}\ncase "$*" in *install*) exit 1;; esac\n')
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", KVCFS_VENV=str(tmp_path / "venv"),
               KVCFS_BINDIR=str(tmp_path / "bin"))  # fmt: skip
    env.pop("PYTHON", None)
    return env


def _setup_asks_for(tmp_path: Path, script: str) -> set[str]:
    """The system packages a setup script asks apt-get for (this module runs as root)."""
    env = _setup_env(tmp_path)
    r = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr  # stopped by the failing apt-get install
    assert not (tmp_path / "venv").exists() and not (tmp_path / "bin").exists()
    log = (tmp_path / "apt.log").read_text()
    installs = [line.split() for line in log.splitlines() if line.split()[0] == "install"]
    assert len(installs) == 1, log
    return {w for w in installs[0][1:] if not w.startswith("-")}


def test_setup_for_running_installs_nothing_test_only(tmp_path: Path) -> None:
    asked = _setup_asks_for(tmp_path, "setup.sh")
    assert "fuse3" in asked
    assert not asked & TEST_ONLY, asked


def test_setup_for_tests_adds_the_test_only_packages(tmp_path: Path) -> None:
    asked = _setup_asks_for(tmp_path, "setup-dev.sh")
    assert {"fuse3"} | TEST_ONLY <= asked, asked


def test_setup_names_a_python_too_old(tmp_path: Path) -> None:
    old = tmp_path / "python3.10"  # this interpreter, saying it is 3.10
    pretend = 'import sys; sys.version_info = (3, 10, 13, "final", 0); exec(sys.argv[1])'
    _stub(old, f'[ "$1" = -c ] || exit 2\nexec {sys.executable} -c \'{pretend}\' "$2"\n')
    env = dict(_setup_env(tmp_path), PYTHON=str(old))
    r = subprocess.run(["bash", str(ROOT / "scripts/setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"PYTHON={old} is 3.10; kv-chunk-fs needs Python 3.11 or newer" in r.stderr, r.stderr
    assert not (tmp_path / "apt.log").exists() and not (tmp_path / "venv").exists()  # stopped before anything
