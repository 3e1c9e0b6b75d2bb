"""The FUSE device and the mount: open ``/dev/fuse``, mount it, unmount it, register backing files.

As root, mount(2) is called directly with the device's descriptor in the options (``fd=N``), as
libfuse does. As another user, ``fusermount3`` (setuid root) mounts and hands the descriptor back
over a socket pair (``_FUSE_COMMFD``, SCM_RIGHTS). Unmounting is lazy (``MNT_DETACH``): files
still open keep the file system until they are closed, and the session serves them meanwhile.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import socket
import stat
import struct
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvchunkfs.fuse import protocol

log = logging.getLogger(__name__)

DEVICE = "/dev/fuse"
FUSERMOUNT = "fusermount3"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_SYNCHRONOUS, MS_DIRSYNC, MS_NOATIME = 1, 2, 4, 8, 16, 128, 1024
MNT_DETACH = 2
CAP_SYS_ADMIN = 21

# Options mount(8) turns into flags: (set, clear).
_FLAG_OPTIONS = {
    "rw": (0, MS_RDONLY), "ro": (MS_RDONLY, 0),
    "suid": (0, MS_NOSUID), "nosuid": (MS_NOSUID, 0),
    "dev": (0, MS_NODEV), "nodev": (MS_NODEV, 0),
    "exec": (0, MS_NOEXEC), "noexec": (MS_NOEXEC, 0),
    "async": (0, MS_SYNCHRONOUS), "sync": (MS_SYNCHRONOUS, 0),
    "atime": (0, MS_NOATIME), "noatime": (MS_NOATIME, 0),
    "dirsync": (MS_DIRSYNC, 0),
}  # fmt: skip
_KERNEL_OPTIONS = ("default_permissions", "allow_other", "max_read=", "blksize=")


@dataclass
class MountOptions:
    """A set of mount options (as libfuse takes them) split into what each part of the mount uses."""

    flags: int = MS_NOSUID | MS_NODEV  # libfuse's defaults
    kernel: list[str] = field(default_factory=list)  # the FUSE file system's own options
    fsname: str | None = None  # the "device" /proc/mounts shows
    subtype: str | None = None  # the type is fuse.SUBTYPE

    @classmethod
    def parse(cls, options: Iterable[str]) -> MountOptions:
        out = cls()
        for opt in sorted(options):
            if opt in _FLAG_OPTIONS:
                on, off = _FLAG_OPTIONS[opt]
                out.flags = (out.flags | on) & ~off
            elif opt.startswith("fsname="):
                out.fsname = opt.partition("=")[2]
            elif opt.startswith("subtype="):
                out.subtype = opt.partition("=")[2]
            elif opt in _KERNEL_OPTIONS or opt.startswith(_KERNEL_OPTIONS[2:]):
                out.kernel.append(opt)
            else:
                raise ValueError(f"unknown mount option {opt!r}")
        return out

    def fusermount(self) -> str:
        """The ``-o`` of fusermount3 (it adds fd, rootmode, user_id and group_id itself)."""
        flags = [name for name, (on, _) in _FLAG_OPTIONS.items() if on and self.flags & on]
        named = [f"fsname={self.fsname}"] if self.fsname else []
        named += [f"subtype={self.subtype}"] if self.subtype else []
        return ",".join(["rw" if not self.flags & MS_RDONLY else "ro", *flags, *self.kernel, *named])


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _oserror(what: str, path: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}", path)


def mount(mountpoint: str, options: Iterable[str]) -> int:
    """Mount a FUSE file system on ``mountpoint``; the device descriptor that serves it (blocking,
    close-on-exec). OSError if the mount fails."""
    opts = MountOptions.parse(options)
    if os.geteuid() == 0:
        return _mount_syscall(mountpoint, opts)
    return _mount_fusermount(mountpoint, opts)


def _mount_syscall(mountpoint: str, opts: MountOptions) -> int:
    st = os.stat(mountpoint)
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    data = [*opts.kernel, f"fd={fd}", f"rootmode={stat.S_IFMT(st.st_mode):o}", f"user_id={os.getuid()}",
            f"group_id={os.getgid()}"]  # fmt: skip
    source = opts.fsname or opts.subtype or DEVICE
    fstype = f"fuse.{opts.subtype}" if opts.subtype else "fuse"
    libc = _libc()
    if libc.mount(source.encode(), mountpoint.encode(), fstype.encode(), opts.flags, ",".join(data).encode()) != 0:
        err = _oserror("mount", mountpoint)
        os.close(fd)
        raise err
    return fd


def _mount_fusermount(mountpoint: str, opts: MountOptions) -> int:
    """fusermount3 mounts and sends the device descriptor back over a socket pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours:
        try:
            env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
            argv = [FUSERMOUNT, "-o", opts.fusermount(), "--", mountpoint]
            proc = subprocess.Popen(argv, env=env, pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE)
        finally:
            theirs.close()
        fds: list[int] = []
        try:
            _, ancdata, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += list(memoryview(data).cast("i"))
        finally:
            _, err = proc.communicate()
    if proc.returncode != 0 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        message = err.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        raise OSError(errno.EPERM, f"{FUSERMOUNT} failed: {message}", mountpoint)
    return fds[0]


def unmount(mountpoint: str) -> None:
    """Detach the mount (lazily: open files keep it until closed). OSError if that fails."""
    if os.geteuid() == 0:
        if _libc().umount2(mountpoint.encode(), MNT_DETACH) != 0:
            raise _oserror("umount2", mountpoint)
        return
    r = subprocess.run([FUSERMOUNT, "-u", "-q", "-z", "--", mountpoint], capture_output=True)
    if r.returncode != 0:
        raise OSError(errno.EINVAL, f"{FUSERMOUNT} -u failed: {r.stderr.decode(errors='replace').strip()}")


def connection_gone(fd: int) -> bool:
    """True once the kernel has ended the connection (unmounted, or aborted): the device polls POLLERR."""
    p = select.poll()
    p.register(fd, 0)
    return any(ev & select.POLLERR for _, ev in p.poll(0))


def may_pass_through() -> str | None:
    """Why this process cannot register backing files (the kernel asks for CAP_SYS_ADMIN), or None."""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
    except OSError as e:
        return f"cannot read this process's capabilities: {e}"
    if not int(caps, 16) >> CAP_SYS_ADMIN & 1:
        return "the daemon lacks CAP_SYS_ADMIN (not root), which backing files need"
    return None


def backing_open(dev: int, fd: int) -> int:
    """Register ``fd``'s open file as a backing file; its backing id. OSError if the kernel refuses
    (EPERM: passthrough not negotiated; ELOOP: stacked too deep; EINVAL: no read/write_iter)."""
    arg = bytearray(protocol.BACKING_MAP.pack(fd, 0, 0))
    return fcntl.ioctl(dev, protocol.DEV_IOC_BACKING_OPEN, arg, True)


def backing_close(dev: int, backing_id: int) -> None:
    fcntl.ioctl(dev, protocol.DEV_IOC_BACKING_CLOSE, struct.pack("=I", backing_id))
