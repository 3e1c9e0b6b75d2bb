"""Security regressions (the "Hardening" issue): what another local user, a hostile store entry or a
malformed request can do to the daemon and the store.

Every test mounts the real filesystem as root with ``allow_other`` (as deployed) and acts as a real
unprivileged user, created here if absent, through ordinary file calls and programs.
"""

from __future__ import annotations

import errno
import itertools
import os
import pwd
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import SRC, Mount, is_mounted
from helpers import prepare_commit, rand_bytes

MiB = 1 << 20
USER = "kvcfs-test"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="session")
def user() -> User:
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
        pw = pwd.getpwnam(USER)
    return User(USER, pw.pw_uid, pw.pw_gid)


def as_user(user: User, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a shell script as ``user`` (no supplementary groups), as a local attacker would."""
    return subprocess.run(
        ["/bin/bash", "-c", script],
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is 0700): store and mount live here,
    as /var/lib/kv-chunk-fs and /srv/kv-slots do."""
    base = Path(tempfile.mkdtemp(prefix="kvcfs-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start_mount(base: Path, log: Path, extra: list[str] | None = None) -> Mount:
    m = Mount(base / "store", base / "mnt", log)
    m.start(extra)
    return m


def stop_mount(m: Mount) -> None:
    if m.proc is not None and m.proc.poll() is not None and is_mounted(m.mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], check=False)  # a daemon that died
    m.stop()


@pytest.fixture
def fs(shared: Path, tmp_path: Path) -> Iterator[Mount]:
    m = start_mount(shared, tmp_path / "daemon.log")
    try:
        yield m
    finally:
        stop_mount(m)


def alive(m: Mount) -> bool:
    """The daemon still runs and serves the mount."""
    if m.proc is None or m.proc.poll() is not None:
        return False
    try:
        os.listdir(m.mnt)
    except OSError:
        return False
    return True


def kv_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    env["PYTHONPATH"] = str(SRC)
    cmd = [sys.executable, "-m", "kvchunkfs.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def unix_api(m: Mount) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(m.store / "api.sock"))
    return httpx.Client(transport=transport, base_url="http://kvcfs", timeout=120)


def user_dir(m: Mount, user: User, name: str = "d") -> Path:
    """A directory on the mount owned by ``user`` (what llama-server's user has)."""
    d = m.mnt / name
    d.mkdir()
    os.chown(d, user.uid, user.gid)
    return d


# -- 1: a path longer than PATH_MAX inside the store ------------------------------------------------


def test_path_longer_than_path_max_in_the_store_harms_nothing(fs: Mount, user: User) -> None:
    """A user nests directories, then renames the top one longer: the store path of the deepest entry
    passes PATH_MAX. Listing it must fail cleanly, and recovery, GC and fsck must still handle the store
    (GC keeping that deep snapshot's chunks)."""
    user_dir(fs, user)
    data = rand_bytes(3 * MiB, 1)
    src = fs.store.parent / "data"
    src.write_bytes(data)
    src.chmod(0o644)
    # Store path of the deep file: 4066 bytes now, 4121 (> PATH_MAX - 1) once "t" is 255 long.
    prefix = len(os.fsencode(fs.store / "snapshots" / "d")) + 1
    names, left = ["t" * 200], 4066 - prefix - 201
    while left > 2 * 201:
        names.append("n" * 200)
        left -= 201
    names.append("m" * (left - 101))
    leaf = "f" * 100
    chain = "/".join(names)
    assert prefix + len(chain) + 1 + len(leaf) == 4066
    r = as_user(user, f"cd {fs.mnt}/d && mkdir -p {chain} && cp {src} {chain}/{leaf} && mv {'t' * 200} {'T' * 255}")
    assert r.returncode == 0, r.stderr
    moved = chain.replace("t" * 200, "T" * 255, 1)
    r = as_user(user, f"cd {fs.mnt}/d/{moved} && ls -la")
    assert r.returncode != 0 and "too long" in r.stderr.lower(), r.stdout + r.stderr
    assert alive(fs), fs.log()[-3000:]
    assert "readdir" in fs.log(), "the failure is logged"

    with unix_api(fs) as api:
        gc = api.post("/gc")
    assert gc.status_code == 200, gc.text
    assert gc.json()["errors"] == [] and gc.json()["missing_chunks"] == 0
    check = kv_cli("fsck", "--store", str(fs.store))
    assert check.returncode == 0, check.stdout + check.stderr

    fs.stop()
    offline = kv_cli("fsck", "--store", str(fs.store))
    assert offline.returncode == 0, offline.stdout + offline.stderr
    fs.start_settled()  # recovery and the GC at mount walk the store
    assert "recovery:" in fs.log()
    os.rename(fs.mnt / "d" / ("T" * 255), fs.mnt / "d" / ("t" * 200))
    assert (fs.mnt / "d" / chain / leaf).read_bytes() == data, "GC kept the deep snapshot's chunks"


# -- 2: a damaged snapshot, truncated or appended to ------------------------------------------------


def damage_chunk(m: Mount, name: str, i: int, how: str) -> bytes:
    """With the daemon stopped, drop chunk ``i`` of ``name`` from the map (and damage its bytes) or
    flip a byte of it."""
    from kvchunkfs.store import stubs

    m.ingested()  # the stub names the chunks once the save is stored
    cid = stubs.read_index(m.store / "snapshots" / name).ids[i]
    m.stop()
    db = sqlite3.connect(m.store / "chunks.db")
    try:
        pack, off, length = db.execute("SELECT pack, offset, length FROM chunks WHERE id = ?", (cid,)).fetchone()
        if how == "missing":
            db.execute("DELETE FROM chunks WHERE id = ?", (cid,))
            db.commit()
    finally:
        db.close()
    # Missing: the row is gone and the bytes damaged too (else recovery re-maps the chunk from its
    # pack's records); corrupt: the row stays and the bytes fail their checksum.
    if how in ("corrupt", "missing"):
        with open(m.store / "packs" / f"{pack:08d}.pack", "r+b") as f:
            f.seek(off + length // 2)
            byte = f.read(1)[0]
            f.seek(off + length // 2)
            f.write(bytes([byte ^ 0x55]))
    # No hot copy: an open puts the snapshot back from its chunks (where the damage is).
    m.start(["--hot-tier-size", "0"])
    return cid


@pytest.mark.parametrize("how", ["missing", "corrupt"])
@pytest.mark.parametrize("op", ["truncate", "extend"])
def test_truncating_or_extending_a_damaged_snapshot_is_eio_for_that_file_only(fs: Mount, op: str, how: str) -> None:
    a, b = rand_bytes(3 * MiB, 10), rand_bytes(2 * MiB, 11)
    fs.path("a").write_bytes(a)
    fs.path("b").write_bytes(b)
    stub = fs.store / "snapshots" / "a"
    cid = damage_chunk(fs, "a", 1, how)
    before = stub.read_bytes()

    if op == "truncate":  # shrinking copies the whole content to staging first
        with pytest.raises(OSError) as e:
            os.truncate(fs.path("a"), 100)
    else:  # append: a rewrite copies the current version first, put back from the chunks: its
        with pytest.raises(OSError) as e:  # open already fails
            fd = os.open(fs.path("a"), os.O_WRONLY)
            try:
                os.pwrite(fd, b"x" * 5000, len(a))
                os.pwrite(fd, b"y" * 5000, len(a) + 5000 + 70000)
            finally:
                os.close(fd)
    assert e.value.errno == errno.EIO
    assert alive(fs), fs.log()[-3000:]
    assert stub.read_bytes() == before, "the damaged snapshot's stub is untouched"
    assert fs.path("b").read_bytes() == b
    fs.path("c").write_bytes(b"still saving")
    assert fs.path("c").read_bytes() == b"still saving"
    # The open puts the file back from its chunks and fails there: the damaged chunk is logged.
    served = [line for line in fs.log().splitlines() if "ERROR kvchunkfs.fuse" in line]
    assert any(cid.hex() in line for line in served), fs.log()[-3000:]


# -- 5 and 6: the store is the daemon's user's alone ------------------------------------------------


def mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o7777


def test_other_users_can_neither_enter_the_store_nor_read_its_bytes(fs: Mount, user: User) -> None:
    """A user owning mnt/d owns STORE/snapshots/d: with a traversable store they could plant a symlink
    there for the daemon to follow, and read every snapshot's bytes from packs and map."""
    d = user_dir(fs, user)
    secret = rand_bytes(2 * MiB, 20)
    fs.path("secret").write_bytes(secret)  # root's snapshot, mode 0644 on the mount
    fs.path("secret").chmod(0o600)
    fs.ingested()

    def assert_private(n: int) -> None:
        store = fs.store
        # Staged saves and hot copies hold whole snapshots: their directory is as private as the store.
        assert mode(fs.whole) == 0o700 and mode(fs.whole.parent) == 0o700
        assert fs.path("secret").read_bytes() == secret  # a whole copy of it exists now
        copies = [f for f in fs.whole.rglob("*") if f.is_file() and f.stat().st_size == len(secret)]
        assert copies, list(fs.whole.rglob("*"))
        for f in copies:
            assert mode(f) == 0o600, f
            r = as_user(user, f"cat {f} | wc -c")
            assert "Permission denied" in r.stderr, (f, r.stdout, r.stderr)
        assert mode(store) == 0o700
        assert mode(store / "packs") == 0o700 and mode(store / "tmp") == 0o700 and mode(store / "staging") == 0o700
        packs = list((store / "packs").glob("*.pack"))
        assert packs
        for f in [*packs, *store.glob("chunks.db*")]:
            assert mode(f) == 0o600, f
        r = as_user(user, f"ln -s /etc/passwd {store}/snapshots/d/planted")
        assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
        assert not os.path.lexists(store / "snapshots" / "d" / "planted")
        for f in [store / "chunks.db", *packs]:
            r = as_user(user, f"cat {f} | wc -c")
            assert "Permission denied" in r.stderr, (f, r.stdout, r.stderr)
        r = as_user(user, f"cat {fs.mnt}/secret")
        assert "Permission denied" in r.stderr and r.stdout == ""
        # The mount itself still works for the user.
        mine = f"{d}/mine{n}"
        r = as_user(user, f"seq {n} 100000 > {mine} && echo end >> {mine} && cmp {mine} <(seq {n} 100000; echo end)")
        assert r.returncode == 0, r.stderr

    assert_private(1)
    # A store made before this rule (0755, 0644 files) is tightened at the next mount.
    fs.stop()
    for p in [fs.store, fs.store / "packs", fs.store / "tmp", fs.store / "staging"]:
        p.chmod(0o755)
    for p in [*(fs.store / "packs").glob("*.pack"), *fs.store.glob("chunks.db*")]:
        p.chmod(0o644)
    fs.start()
    assert_private(2)
    assert fs.path("secret").read_bytes() == secret


def test_the_stats_xattr_is_refused_to_other_users(fs: Mount, user: User) -> None:
    """``user.kvcfs.stats`` counts every user's saves and restores and the bytes found in the store
    already: read by another user it was a dedup oracle (save a guess, see ``bytes_deduped`` grow
    by its size if another user's private snapshot holds it). Only the daemon's user reads it."""
    secret = rand_bytes(2 * MiB, 21)
    fs.path("secret").write_bytes(secret)
    fs.path("secret").chmod(0o600)
    d = user_dir(fs, user)
    fs.ingested()
    before = fs.stats()  # the daemon's user (root here) still reads it
    assert before["bytes_written"] >= len(secret)
    guess = d / "guess"
    guess.write_bytes(secret)  # the attacker's guess, saved through the mount (as root: no python for them)
    os.chown(guess, user.uid, user.gid)
    r = as_user(user, f"getfattr --only-values -n user.kvcfs.stats {fs.mnt}")
    assert r.returncode != 0 and "Permission denied" in r.stderr, (r.stdout, r.stderr)
    assert "bytes_deduped" not in r.stdout
    r = as_user(user, f"getfattr -d -m - {fs.mnt}")  # every attribute it may list: none of the figures
    assert "bytes_deduped" not in r.stdout and "saves" not in r.stdout, r.stdout
    fs.ingested()
    assert fs.stats()["saves"] > before["saves"]


def test_attribute_changes_never_follow_a_symlink_in_the_store(fs: Mount, user: User, shared: Path) -> None:
    """However a symlink got into the store (planted before the store was private, or by root), chgrp -h
    and touch -h on it through the mount change the link, never its target (root's /etc/shadow...)."""
    user_dir(fs, user)
    victim = shared / "victim"
    victim.write_bytes(b"root's file")
    os.utime(victim, ns=(10**18, 10**18))
    link = fs.store / "snapshots" / "d" / "link"
    link.symlink_to(victim)
    os.chown(link, user.uid, user.gid, follow_symlinks=False)  # as if the user had made it
    before = os.stat(victim)
    r = as_user(user, f"chgrp -h {user.gid} {fs.mnt}/d/link && touch -h -d @1000000 {fs.mnt}/d/link")
    after = os.stat(victim)
    assert (after.st_uid, after.st_gid, after.st_mode, after.st_mtime_ns) == (
        before.st_uid, before.st_gid, before.st_mode, before.st_mtime_ns
    ), r.stderr  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert victim.read_bytes() == b"root's file"
    assert os.lstat(link).st_gid == user.gid and os.lstat(link).st_mtime == 1000000, "the link itself changed"
    assert alive(fs)


# -- 8: a FIFO among the stubs ----------------------------------------------------------------------

HANG = 60  # seconds after which a command counts as hung (a guard, not a timing assertion)


def test_a_fifo_among_the_stubs_is_named_and_skipped_never_opened(fs: Mount, user: User) -> None:
    user_dir(fs, user)
    data = rand_bytes(2 * MiB, 30)
    fs.path("d/snap").write_bytes(data)
    snaps = fs.store / "snapshots"
    os.mkfifo(snaps / "d" / "fifo")  # planted (e.g. before the store was private)
    (snaps / "d" / "to-fifo").symlink_to("fifo")

    r = kv_cli("fsck", "--store", str(fs.store), timeout=HANG)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped: d/fifo: a FIFO, not a snapshot" in r.stdout and "d/to-fifo: a symlink" in r.stdout
    with unix_api(fs) as api:
        report = api.post("/gc", params={"walk": "true"}, timeout=HANG).json()  # a walk reads every entry
        listing = api.get("/snapshots", timeout=HANG).json()
    assert report["errors"] == [] and report["snapshots"] == 1
    assert any(s.startswith("d/fifo: a FIFO") for s in report["skipped"]), report
    assert [row["path"] for row in listing["snapshots"]] == ["d/snap"]

    fs.stop()
    r = kv_cli("gc", "--store", str(fs.store), timeout=HANG)
    assert r.returncode == 0 and "d/fifo: a FIFO" in r.stdout, r.stdout + r.stderr
    fs.start_settled()  # recovery and the GC at mount
    assert "not a snapshot, skipped: d/fifo: a FIFO" in fs.log()
    assert fs.path("d/snap").read_bytes() == data
    assert sorted(os.listdir(fs.mnt / "d")) == ["fifo", "snap", "to-fifo"]


# -- 7: the TCP API --------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_http(user: User, port: int, request_line: str, token: str = "") -> str:
    """An HTTP request sent by ``user`` with nothing but bash; the status line of the answer."""
    auth = f"Authorization: Bearer {token}\\r\\n" if token else ""
    r = as_user(user, f"exec 3<>/dev/tcp/127.0.0.1/{port} && "
                      f"printf '{request_line} HTTP/1.1\\r\\nHost: x\\r\\n{auth}Connection: close\\r\\n\\r\\n' >&3 && "
                      "head -n 1 <&3")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_tcp_api_without_a_token_is_refused_unless_explicitly_allowed(shared: Path, tmp_path: Path,
                                                                     user: User) -> None:  # fmt: skip
    port = free_port()
    m = Mount(shared / "store", shared / "mnt", tmp_path / "daemon.log")
    try:
        with pytest.raises(RuntimeError, match="daemon exited 2"):
            m.start(["--api-address", f"127.0.0.1:{port}"])
        assert "refusing to serve the API on 127.0.0.1:" in m.log() and "api_token_file" in m.log()
        assert "Traceback" not in m.log()
        # Opting in is explicit, and said in the log.
        m.start(["--api-address", f"127.0.0.1:{port}", "--api-insecure-no-token"])
        assert "open by every local user without a token" in m.log()
        m.path("victim").write_bytes(b"x")
        assert "200" in raw_http(user, port, "DELETE /snapshots/victim")
        assert not m.path("victim").exists()
        assert "API deleted snapshot victim (by 127.0.0.1:" in m.log(), "the caller is named"
    finally:
        stop_mount(m)


def test_token_from_a_file_and_every_delete_and_gc_names_its_caller(shared: Path, tmp_path: Path,
                                                                    user: User) -> None:  # fmt: skip
    port, token = free_port(), "s3cret-token-from-a-file"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    m = Mount(shared / "store", shared / "mnt", tmp_path / "daemon.log")
    m.start(["--api-address", f"127.0.0.1:{port}", "--api-token-file", str(token_file)])
    try:
        assert m.proc is not None
        assert token not in Path(f"/proc/{m.proc.pid}/cmdline").read_text(), "not visible in ps"
        m.path("victim").write_bytes(b"x")
        assert "401" in raw_http(user, port, "DELETE /snapshots/victim")
        assert "401" in raw_http(user, port, "DELETE /snapshots/victim", token="guess")
        assert "401" in raw_http(user, port, "POST /gc")
        assert m.path("victim").exists()
        assert "API DELETE /snapshots/victim refused: missing or wrong token (from 127.0.0.1:" in m.log()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}) as h:
            assert h.post("/gc", timeout=HANG).status_code == 200
            assert h.delete("/snapshots/victim").status_code == 200
        assert "API GC requested by 127.0.0.1:" in m.log()
        assert "API deleted snapshot victim (by 127.0.0.1:" in m.log()
        m.path("other").write_bytes(b"y")
        with unix_api(m) as api:
            assert api.delete("/snapshots/other").status_code == 200
        assert f"API deleted snapshot other (by uid 0 pid {os.getpid()} (unix socket))" in m.log()
    finally:
        stop_mount(m)
    # Both a token and a token file, or an empty token file: clear errors.
    r = kv_cli("config", "--api-token", "a", "--api-token-file", str(token_file))
    assert r.returncode == 2 and "both set" in r.stderr, r.stderr
    token_file.write_text("\n")
    with pytest.raises(RuntimeError, match="daemon exited 2"):
        m.start(["--api-address", f"127.0.0.1:{port}", "--api-token-file", str(token_file)])
    stop_mount(m)
    assert "holds no token" in m.log() and "Traceback" not in m.log()


# -- the dashboard ---------------------------------------------------------------------------------


def http_as(user: User, port: int, request_line: str, headers: list[str]) -> str:
    """Like raw_http with headers of our choice (Host a loopback name: the dashboard answers to no other)."""
    extra = "".join(f"{h}\\r\\n" for h in headers)
    r = as_user(user, f"exec 3<>/dev/tcp/127.0.0.1/{port} && "
                      f"printf '{request_line} HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n{extra}Content-Length: 0\\r\\n"
                      "Connection: close\\r\\n\\r\\n' >&3 && head -n 1 <&3")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def start_dashboard(store: Path, log: Path) -> tuple[subprocess.Popen[bytes], int, str]:
    """``kv-chunk-fs ui`` with no token configured; (process, port, the URL it printed)."""
    import re

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    env["PYTHONPATH"] = str(SRC)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvchunkfs.cli", "ui", "--store", str(store), "--listen",
                                 f"127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ui-config", timeout=2).status_code == 200:
                printed = re.search(r"dashboard on (http://\S+)", log.read_text())
                assert printed, log.read_text()
                return proc, port, printed.group(1)
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"ui did not start: {log.read_text()}")


def test_the_dashboard_without_a_configured_token_refuses_other_users_and_names_the_real_caller(
    fs: Mount, user: User, tmp_path: Path
) -> None:
    fs.path("victim").write_bytes(b"x")
    proc, port, url = start_dashboard(fs.store, tmp_path / "ui.log")
    try:
        assert url.startswith(f"http://127.0.0.1:{port}/?token="), url
        token = url.partition("?token=")[2]
        assert len(token) >= 32
        ui = ["X-KVCFS-UI: 1"]
        for line in ("DELETE /api/snapshots/victim", "POST /api/gc", "GET /api/logs", "GET /api/prefix-tree",
                     "GET /api/stats", "GET /api/snapshots"):  # fmt: skip
            assert " 401 " in http_as(user, port, line, ui), line
            assert " 401 " in http_as(user, port, line, [*ui, "Authorization: Bearer guess"]), line
        assert fs.path("victim").exists()
        assert "API GC requested" not in fs.log()
        # With the token (handed over by the operator) the user may delete, and the audit line names them.
        assert " 200 " in http_as(user, port, "DELETE /api/snapshots/victim", [*ui, f"Authorization: Bearer {token}"])
        assert not fs.path("victim").exists()
        audit = [line for line in fs.log().splitlines() if "API deleted snapshot victim" in line]
        assert len(audit) == 1 and "(unix socket) for dashboard client 127.0.0.1:" in audit[0], audit
        assert audit[0].endswith(f" uid {user.uid})"), audit
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Each start has a token of its own.
    proc, _, url2 = start_dashboard(fs.store, tmp_path / "ui2.log")
    proc.terminate()
    proc.wait(timeout=30)
    assert url2.partition("?token=")[2] != token


# -- 9: names that are not UTF-8 --------------------------------------------------------------------


def test_names_and_labels_that_are_not_utf8_are_listed_losslessly_and_deletable(fs: Mount, user: User) -> None:
    import base64

    d = user_dir(fs, user)
    src = fs.store.parent / "data"
    src.write_bytes(rand_bytes(MiB, 40))
    src.chmod(0o644)
    # A user names a snapshot and a label with bytes that are not UTF-8.
    r = as_user(user, f"cp {src} {d}/$'bad\\xffname' && cp {src} {d}/good && "
                      f"setfattr -n $'user.kvcfs.label.k\\xfe' -v 0x76fd {d}/$'bad\\xffname'")  # fmt: skip
    assert r.returncode == 0, r.stderr
    bad = os.fsencode(d) + b"/bad\xffname"
    assert os.path.exists(bad)
    fd = os.open(bad, os.O_WRONLY)  # a new version: its "saved" log line names the file
    os.pwrite(fd, b"z", 0)
    os.close(fd)
    fs.ingested()
    (fs.store / "snapshots" / os.fsdecode(b"d/junk\xfe")).write_bytes(b"not an index")

    with unix_api(fs) as api:
        r = api.get("/snapshots")
        assert r.status_code == 200, r.text
        rows = {row.get("path_b64") or row["path"]: row for row in r.json()["snapshots"]}
        assert set(rows) == {"d/good", base64.b64encode(b"d/bad\xffname").decode(),
                             base64.b64encode(b"d/junk\xfe").decode()}  # fmt: skip
        row = rows[base64.b64encode(b"d/bad\xffname").decode()]
        assert row["path"] == "d/bad\ufffdname" and row["size"] == MiB
        assert row["labels"] == {"k\ufffd": "v\ufffd"}
        assert "path_b64" not in rows["d/good"]
        for params in ({}, {"format": "text"}):
            r = api.get("/prefix-tree", params=params)
            assert r.status_code == 200 and "bad\ufffdname" in r.text, r.text
        r = api.get("/logs")
        assert r.status_code == 200, r.text
        assert any("saved d/bad\\xffname:" in line["message"] for line in r.json()["lines"]), r.text
        # The exact bytes, percent-encoded, name the snapshot.
        assert api.get("/snapshots/d/bad%FFname").json()["size"] == MiB
        assert api.get("/snapshots/d/bad%EF%BF%BDname").status_code == 404, "U+FFFD is another name"
        r = api.delete("/snapshots/d/bad%FFname")
        assert r.status_code == 200, r.text
        assert r.json() == {"deleted": "d/bad\ufffdname", "path_b64": base64.b64encode(b"d/bad\xffname").decode()}
    assert not os.path.exists(bad) and (d / "good").exists()
    for cmd in (["ls"], ["ls", "--json"], ["tree"]):
        r = kv_cli(*cmd, "--store", str(fs.store))
        assert r.returncode == 0 and "junk" in r.stdout, (cmd, r.stdout, r.stderr)
    fs.stop()
    r = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "fsck", "--store", str(fs.store)],
                       capture_output=True, env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=300)  # fmt: skip
    assert r.returncode == 1 and b"problem: snapshot d/junk\xfe: not a valid index" in r.stdout, r.stdout + r.stderr
    fs.start()


# -- 13: malformed query parameters -----------------------------------------------------------------


def test_every_malformed_parameter_is_a_400_with_a_message(fs: Mount) -> None:
    fs.path("a").write_bytes(b"x")
    long_number = "9" * 5000  # more digits than int() converts
    cases = [
        ("/snapshots", "limit", "²"),  # str.isdigit() says yes, int() says no
        ("/snapshots", "limit", "١٢"),  # Arabic-Indic digits
        ("/snapshots", "limit", "１"),  # fullwidth
        ("/snapshots", "limit", long_number),
        ("/snapshots", "limit", "-1"),
        ("/snapshots", "min_size", long_number + "GiB"),
        ("/snapshots", "max_use_count", "nan"),
        ("/snapshots", "sort", "label."),
        ("/logs", "limit", "²"),
        ("/logs", "limit", long_number),
        ("/logs", "limit", "99999999999999999999"),
        ("/logs", "level", "²"),
        ("/prefix-tree", "format", "²"),
    ]
    with unix_api(fs) as api:
        for path, name, value in cases:
            r = api.get(path, params={name: value})
            assert r.status_code == 400, (path, name, value[:20], r.status_code, r.text[:200])
            assert name in r.json()["error"], r.text[:200]
        assert api.get("/snapshots", params={"limit": "1"}).json()["count"] == 1
    assert "Traceback" not in fs.log()


# -- 10: sparse files and the largest file ------------------------------------------------------------

GiB = 1 << 30


def test_a_sparse_file_is_saved_without_cutting_its_holes(fs: Mount, user: User) -> None:
    """A user extends a file to 4 GiB with ftruncate and writes a little at both ends: the save stores
    the zero chunk once instead of reading, cutting and hashing 4 GiB of zeros (which took the daemon
    a CPU-minute per GiB while close() blocked)."""
    d = user_dir(fs, user)
    head, tail = random.Random(20).randbytes(300_000), random.Random(21).randbytes(200_000)
    tail_at = 3 * GiB + 12345
    script = f"""import os, random
fd = os.open({str(d / "sparse")!r}, os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, random.Random(20).randbytes(300_000))
os.ftruncate(fd, {4 * GiB})
os.pwrite(fd, random.Random(21).randbytes(200_000), {tail_at})
os.close(fd)
"""
    r = as_user(user, f"python3 - <<'PY'\n{script}PY")
    assert r.returncode == 0, r.stderr
    stats = fs.stats()
    assert stats["bytes_deduped"] < 64 * MiB, f"the holes were cut and hashed: {stats}"
    p = d / "sparse"
    assert p.stat().st_size == 4 * GiB
    with open(p, "rb") as f:
        assert f.read(len(head)) == head
        f.seek(2 * GiB)
        assert f.read(MiB) == bytes(MiB)
        f.seek(tail_at - 5)
        assert f.read(len(tail) + 10) == bytes(5) + tail + bytes(5)
        f.seek(4 * GiB - 10)
        assert f.read() == bytes(10)


def test_writes_and_truncates_beyond_max_file_size_are_efbig(fs: Mount, user: User) -> None:
    """ftruncate(fd, 2**40) then close() kept the daemon busy for 40 minutes: beyond max_file_size
    (64 GiB by default) it is EFBIG, and a file of exactly that size saves at once."""
    d = user_dir(fs, user)
    limit = 64 * GiB
    script = f"""import errno, os
fd = os.open({str(d / "big")!r}, os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"head")
for name, call in (("truncate", lambda: os.ftruncate(fd, 1 << 40)),
                   ("write", lambda: os.pwrite(fd, b"x", {limit})),
                   ("truncate+1", lambda: os.ftruncate(fd, {limit + 1}))):
    try:
        call()
        print(name, "ok")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
os.ftruncate(fd, {limit})
os.pwrite(fd, b"tail", {limit - 4})
os.close(fd)
fd = os.open({str(d / "over")!r}, os.O_WRONLY | os.O_CREAT, 0o600)
os.pwrite(fd, b"x", {limit})
try:
    os.close(fd)
    print("close past the limit ok")
except OSError as e:
    print("close past the limit", errno.errorcode[e.errno])
"""
    r = as_user(user, f"python3 - <<'PY'\n{script}PY")
    assert r.returncode == 0, r.stderr
    # The kernel writes the file (passthrough): a write past the limit cannot be refused, the
    # save is, at its close; a truncate past it is refused at once.
    assert r.stdout.split("\n")[:4] == ["truncate EFBIG", "write ok", "truncate+1 EFBIG", "close past the limit EFBIG"]
    assert (d / "over").stat().st_size == 0, "the refused save left the file its create made"
    p = d / "big"
    assert p.stat().st_size == limit
    with open(p, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(limit - 8)
        assert f.read() == bytes(4) + b"tail"
    fs.ingested()
    assert fs.stats()["bytes_deduped"] < 64 * MiB
    with pytest.raises(OSError) as e:
        os.truncate(p, limit + PAGE_SIZE)
    assert e.value.errno == errno.EFBIG
    assert alive(fs)


PAGE_SIZE = 4096


@pytest.mark.parametrize("seed", range(4))
def test_skipping_holes_chunks_exactly_as_plain_cdc(tmp_path: Path, seed: int) -> None:
    """The hole shortcut (one zero chunk, repeated) against pyfastcdc over the same bytes: holes
    shorter and longer than chunk_max, at the start and the end, data islands of every size."""
    import hashlib

    from pyfastcdc.cy import FastCDC

    from kvchunkfs.file.files import Files
    from kvchunkfs.store.repository import Repository, StoreSettings

    rng = random.Random(seed)
    repo = Repository(tmp_path / "store", StoreSettings())
    files = Files(repo)
    content = files.content(repo.empty_index())
    content.to_staging()
    size = 40 * MiB + rng.randrange(MiB)
    whole = bytearray(size)
    pos = rng.choice([0, rng.randrange(3 * MiB)])
    while pos < size:
        n = min(rng.choice([1, 100, 5000, 70_000, 300_000, 2 * MiB]), size - pos)
        data = rand_bytes(n, rng.randrange(1 << 30))
        content.write(pos, data)
        whole[pos : pos + n] = data
        pos += n + rng.choice([1, 4096, 20_000, 250_000, 262_144, 600_000, 3 * MiB + 7])
    content.truncate(size)
    index, _ = prepare_commit(content)
    cdc = FastCDC(avg_size=64 << 10, min_size=16 << 10, max_size=256 << 10)
    plain = [c.data for c in cdc.cut_buf(bytes(whole))]
    assert list(index.ends) == list(itertools.accumulate(len(c) for c in plain))
    assert index.ids == [hashlib.sha256(c).digest() for c in plain]
    assert files.read_chunks(index, 0, size) == whole
    content.close()
    files.close()


# -- 12: a bounded number of chunker threads ----------------------------------------------------------


def test_many_files_written_at_once_use_a_bounded_number_of_threads(fs: Mount, user: User) -> None:
    """300 files open for writing at once: the daemon's threads stay bounded (none per file), and
    every file still saves exactly."""
    assert fs.proc is not None
    d = user_dir(fs, user)
    files = 300
    script = f"""import os, random, sys
fds = [os.open(f"{d}/f{{i}}", os.O_WRONLY | os.O_CREAT, 0o600) for i in range({files})]
for i, fd in enumerate(fds):
    os.write(fd, random.Random(i).randbytes({4 * MiB + 1000}) if i % 30 == 0 else b"x" * (i + 1))
print("written", flush=True)
sys.stdin.readline()
for fd in fds:
    os.close(fd)
"""
    proc = subprocess.Popen(
        ["python3", "-c", script],
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "written\n"
        threads = len(os.listdir(f"/proc/{fs.proc.pid}/task"))
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert threads < 100, f"{threads} daemon threads for {files} files being written"
    for i in range(files):
        want = random.Random(i).randbytes(4 * MiB + 1000) if i % 30 == 0 else b"x" * (i + 1)
        assert (d / f"f{i}").read_bytes() == want, i
    assert alive(fs)


# -- set-id bits: dropped where the kernel drops them on other file systems ---------------------------


def test_a_write_truncate_trunc_open_or_chown_drops_set_id_bits(fs: Mount, user: User) -> None:
    """Another user writing to a set-user-ID file must not leave it set-user-ID (nor set-group-ID if
    group-executable): a write, a truncate, an O_TRUNC open by a caller without CAP_FSETID, and any
    chown drop them, as the VFS does on other file systems. The mount lets the filesystem drop them
    (HANDLE_KILLPRIV_V2, which spares a GETXATTR per write), so the daemon does."""
    names = ("write", "truncate", "trunc_open", "chown", "root_write", "sgid_no_x")
    for name in names:
        (fs.mnt / name).write_bytes(b"0123456789")
        os.chmod(fs.mnt / name, 0o2767 if name == "sgid_no_x" else 0o6777)
    script = "printf x >> mnt/write && truncate -s 3 mnt/truncate && : > mnt/trunc_open && printf y >> mnt/sgid_no_x"
    r = as_user(user, f"cd {fs.mnt.parent} && {script}")
    assert r.returncode == 0, r.stderr
    os.chown(fs.mnt / "chown", user.uid, -1)
    with open(fs.mnt / "root_write", "ab") as f:  # root has CAP_FSETID: its write keeps them
        f.write(b"z")
    modes = {name: stat.S_IMODE(os.stat(fs.mnt / name).st_mode) for name in names}
    assert modes == {"write": 0o777, "truncate": 0o777, "trunc_open": 0o777, "chown": 0o777,
                     "root_write": 0o6777, "sgid_no_x": 0o2767}, {k: oct(v) for k, v in modes.items()}  # fmt: skip
    assert (fs.mnt / "write").read_bytes() == b"0123456789x" and (fs.mnt / "truncate").read_bytes() == b"012"
    assert (fs.mnt / "trunc_open").read_bytes() == b""
