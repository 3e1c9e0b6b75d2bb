"""JSON answers: orjson, encoded and freed a piece at a time so big answers never hold the GIL long."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.responses import JSONResponse as _StarletteJSONResponse

from kvchunkfs.service import catalog

log = logging.getLogger("kvchunkfs.service.api")  # one name for the whole API in the log


class JSONResponse(_StarletteJSONResponse):
    """JSON whose strings are all valid UTF-8: a file name that is not (reaching a report, an error or a
    log line) is shown with U+FFFD instead of failing the response. Snapshot rows carry the exact
    bytes in ``path_b64`` (``catalog.path_fields``)."""

    def render(self, content: Any) -> bytes:
        try:  # almost always: no name with bytes that are not UTF-8, and no walk of a big answer
            return _dumps(content)
        except TypeError:  # orjson.JSONEncodeError: such a name (a surrogate), an int past 64 bits, ...
            pass
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(_displayable(content))


PIECE = 1000  # list items (rows, snapshots below a tree node) encoded per orjson call


def _dumps(content: Any) -> bytes:
    """orjson, in pieces: orjson holds the GIL for a whole call (40 ms for 50,000 rows), and the
    FUSE thread needs it to answer; between pieces it gets it. A top-level object's long lists go
    ``PIECE`` items at a time; a prefix tree node below which more than ``PIECE`` snapshots lie,
    one child at a time."""
    if not isinstance(content, dict) or not all(isinstance(k, str) for k in content):
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
    return b"{" + b",".join(orjson.dumps(k) + b":" + _dumps_value(v) for k, v in content.items()) + b"}"


def _dumps_value(value: Any, depth: int = 0) -> bytes:
    if isinstance(value, list) and len(value) > PIECE:
        pieces = (orjson.dumps(value[i : i + PIECE])[1:-1] for i in range(0, len(value), PIECE))
        return b"[" + b",".join(pieces) + b"]"
    if isinstance(value, dict) and value.get("shared_count", 0) > PIECE and depth < 100:  # a big tree node
        children = value.get("children", [])
        head = orjson.dumps({k: v for k, v in value.items() if k != "children"})
        kids = b",".join(_dumps_value(child, depth + 1) for child in children)
        return head[:-1] + b',"children":[' + kids + b"]}"
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _release_rows(rows: list) -> None:
    """Drop a long answer's rows ``PIECE`` at a time: freeing 50,000 dicts at once is one C call
    holding the GIL (see ``prefixtree.release``)."""
    while rows:
        del rows[-PIECE:]


def _displayable(value: Any) -> Any:
    if isinstance(value, str):
        return catalog.display_name(value)
    if isinstance(value, dict):
        return {_displayable(k): _displayable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_displayable(v) for v in value]
    return value
