"""A daemon run by an ordinary user: it mounts through fusermount3 (the device descriptor handed
back over a socket pair), serves in served mode (backing files need CAP_SYS_ADMIN), its mount is
its user's alone (no allow_other), a dead daemon's mount is cleared by the next one, and the user
unmounts it with ``fusermount3 -u``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MOUNTED, SRC, is_mounted
from test_security import User, as_user, user  # noqa: F401 - the fixture, with its user

MiB = 1 << 20


@pytest.fixture
def home(user: User) -> Iterator[Path]:  # noqa: F811
    """The user's directory for store, mountpoint and files (pytest's tmp_path is root's, 0700)."""
    base = Path(tempfile.mkdtemp(prefix="kvcfs-user-", dir="/tmp"))
    os.chmod(base, 0o755)
    for d in ("store", "mnt", "home"):
        (base / d).mkdir()
    shutil.chown(base / "store", user.uid, user.gid)
    shutil.chown(base / "mnt", user.uid, user.gid)
    shutil.chown(base / "home", user.uid, user.gid)
    try:
        yield base
    finally:
        if is_mounted(base / "mnt"):
            subprocess.run(["fusermount3", "-u", "-z", str(base / "mnt")], check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def python(user: User, home: Path) -> Iterator[tuple[str, dict[str, str]]]:  # noqa: F811
    """An interpreter the user may run and its environment: this one, or this one's base
    installation bound to a place the user can reach (a pyenv under root's home is not; a virtual
    environment's interpreter is a link into it), with this one's packages on the path."""
    packages = [p for p in sys.path if p.endswith("-packages")]
    probe = as_user(user, f"test -x {sys.executable} && echo yes")
    if probe.stdout.strip() == "yes":
        yield sys.executable, {"PYTHONPATH": os.pathsep.join([str(SRC), *packages])}
        return
    prefix = Path(sys.base_prefix)
    base = prefix / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    place = home / "python"
    place.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(prefix), str(place)], check=True)
    try:
        moved = [str(place / Path(p).relative_to(prefix)) if Path(p).is_relative_to(prefix) else p for p in packages]
        env = {"PYTHONPATH": os.pathsep.join([str(SRC), *moved]), "LD_LIBRARY_PATH": str(place / "lib")}
        yield str(place / base.relative_to(prefix)), env
    finally:
        subprocess.run(["umount", "-l", str(place)], check=False)


class UserDaemon:
    def __init__(self, user: User, home: Path, python: tuple[str, dict[str, str]]) -> None:  # noqa: F811
        self.user, self.home, (self.python, self.env) = user, home, python
        self.mnt, self.log = home / "mnt", home / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        seen = self.log.read_text().count(MOUNTED) if self.log.exists() else 0
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home / "home"), "LC_ALL": "C", **self.env}
        argv = [self.python, "-m", "kvchunkfs.cli", "mount", "--store", str(self.home / "store"), str(self.mnt)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, user=self.user.uid,
                                         group=self.user.gid, extra_groups=[], cwd="/")  # fmt: skip
        deadline = time.monotonic() + 60
        while not (is_mounted(self.mnt) and self.log.read_text().count(MOUNTED) > seen):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def run(self, script: str) -> str:
        r = as_user(self.user, f"cd {self.home} && {script}")
        assert r.returncode == 0, (script, r.stdout, r.stderr, self.log.read_text()[-3000:])
        return r.stdout


def mount_line(mnt: Path) -> str:
    with open("/proc/self/mountinfo") as f:
        return next(line for line in f if line.split()[4] == str(mnt))


def test_a_user_mounts_through_fusermount3_serves_and_unmounts(
    user: User,  # noqa: F811
    home: Path,
    python: tuple[str, dict[str, str]],
) -> None:
    d = UserDaemon(user, home, python)
    d.start()
    try:
        assert f"user_id={user.uid}" in mount_line(d.mnt) and "allow_other" not in mount_line(d.mnt)
        deadline = time.monotonic() + 30  # logged when the kernel's INIT arrives, maybe after "mounted"
        while "served mode: the daemon lacks CAP_SYS_ADMIN" not in d.log.read_text():
            assert time.monotonic() < deadline, d.log.read_text()
            time.sleep(0.05)
        d.run("head -c 3000001 /dev/urandom > home/x && cp home/x mnt/a && cmp home/x mnt/a && mv mnt/a mnt/b"
              " && mkdir mnt/dir && cp home/x mnt/dir/c && cmp mnt/b mnt/dir/c")  # fmt: skip
        with pytest.raises(PermissionError):  # without allow_other the mount is its user's alone
            os.listdir(d.mnt)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGKILL)  # a dead daemon leaves "Transport endpoint is not connected"
        d.proc.wait(timeout=30)
        assert "not connected" in as_user(user, f"ls {d.mnt}").stderr
        d.start()  # clears it (fusermount3 -u -z, as the user) and mounts again
        d.run("cmp home/x mnt/b && cmp home/x mnt/dir/c && rm mnt/b")
        d.run("fusermount3 -u mnt")
        assert d.proc.wait(timeout=30) == 0, d.log.read_text()[-3000:]
        assert not is_mounted(d.mnt)
        assert "ERROR" not in d.log.read_text(), d.log.read_text()
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
