"""systemd's readiness protocol (``sd_notify``): one datagram to the unix socket in ``NOTIFY_SOCKET``.

A few lines instead of libsystemd: the unit is ``Type=notify``, so systemd (and ``systemctl start``)
waits for ``READY=1``, which the daemon sends once the mount answers. Without ``NOTIFY_SOCKET`` (not
started by systemd) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); False if there is no socket or sending failed."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:  # the service still runs; systemd then times the start out and says why
        log.warning("sd_notify %r to %s failed: %s", state, address, e)
        return False
    return True
