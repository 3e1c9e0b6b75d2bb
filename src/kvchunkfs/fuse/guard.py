"""Every request handler answers: an unexpected exception becomes an errno and one log line."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from kvchunkfs.file.saves import errno_of as _errno_of
from kvchunkfs.fuse import api as fuse

log = logging.getLogger("kvchunkfs.fuse.operations")  # the handlers' log, as before the split

T = TypeVar("T")


# The caller's own mistake (a size past max_file_size, a bad argument) is logged at debug: any
# local user could fill the log with ERROR lines otherwise. The store's trouble (EIO, ENOSPC, a
# stub that is no snapshot, a missing or corrupt chunk) stays an error.
CALLER_ERRNOS = frozenset({errno.EFBIG, errno.EINVAL})


def level(e: BaseException) -> int:
    """The log level of a request that failed with ``e``."""
    return logging.DEBUG if isinstance(e, OSError) and e.errno in CALLER_ERRNOS else logging.ERROR


def _guarded(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` that answers an unexpected exception with an errno and a log line.

    The session answers anything else with EIO too, but without saying which handler failed and
    why; and an exception in ``forget`` (no reply to carry it) is logged here and dropped.
    """

    @functools.wraps(handler)
    async def guard(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(self, *args, **kwargs)
        except fuse.FUSEError:
            if name == "forget":  # no reply to carry it
                log.error("forget failed with a FUSEError; ignored")
                return None
            raise
        except Exception as e:
            code = _errno_of(e)
            # An OSError is the store's answer (one line); anything else is a bug (traceback).
            log.log(
                level(e),
                "%s failed (%s): %s: %s",
                name,
                errno.errorcode.get(code, code),
                type(e).__name__,
                e,
                exc_info=not isinstance(e, OSError),
            )
            if name == "forget":
                return None
            raise fuse.FUSEError(code) from None

    return guard


def guard_handlers(cls: type[T]) -> type[T]:
    """Wrap every request handler of ``cls`` (all async methods the session calls) with ``_guarded``."""
    for name, value in vars(fuse.Operations).items():
        if inspect.iscoroutinefunction(value):
            setattr(cls, name, _guarded(name, getattr(cls, name)))
    return cls
