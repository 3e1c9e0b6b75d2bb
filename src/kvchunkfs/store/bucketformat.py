"""The format a bucket records (``PREFIX/format``, written once) and each index object carries.

A snapshot's index names chunks of its *stored stream*. How that stream maps to the file's bytes
depends on the store's chunker: ``relayout`` stores K/V blocks token-major (groups of
``group_width`` bytes a cell) and reads put them back; ``format`` and ``cdc`` store the file's
bytes as they are. A host that read another chunker's stream would return a permutation of the
file, so a host whose store differs from the bucket's recorded format refuses the bucket, and
every index object also says (metadata ``kvcfs-format``) what its stream needs, checked again
before it is installed. Chunk sizes do not change the bytes, but a host cutting with other sizes
would share almost nothing: it is refused too (a misconfiguration, not a fleet).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

LAYOUT = 1  # loose: one object per chunk (store/s3.py)
KNOWN_LAYOUTS = (1,)
MAX_FORMAT_BYTES = 64 << 10  # a format object is a few hundred bytes; never parse more


class FormatError(ValueError):
    """A format object that is not one (unparseable, missing fields, unknown values)."""


class FormatMismatch(OSError):
    """This host's store cannot share the bucket (an OSError: a fetch it stops answers EIO)."""


@dataclass(frozen=True)
class BucketFormat:
    layout: int
    chunker: str
    chunk_min: int
    chunk_avg: int
    chunk_max: int
    group_width: int  # relayout: bytes a cell of a stored group; 0 for the other chunkers
    digest: str = "sha256"

    @property
    def stream(self) -> str:
        """What reading a snapshot's stored stream needs: the tag each index object carries."""
        return f"relayout/{self.group_width}" if self.group_width else "plain"

    def to_json(self) -> bytes:
        return json.dumps({"kv-chunk-fs": "bucket format"} | asdict(self), indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> BucketFormat:
        if len(data) > MAX_FORMAT_BYTES:
            raise FormatError(f"a format object of {len(data)} bytes")
        try:
            raw: Any = json.loads(data)
        except (UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise FormatError("not a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = raw.get(f.name)
            want = int if f.type in ("int", int) else str
            if not isinstance(v, want) or isinstance(v, bool):
                raise FormatError(f"field {f.name!r} is {v!r}")
            values[f.name] = v
        return cls(**values)

    def mismatch(self, bucket: BucketFormat) -> str | None:
        """Why a host whose store is ``self`` cannot use a bucket of format ``bucket`` (None: it can)."""
        if bucket.layout not in KNOWN_LAYOUTS:
            return f"the bucket's layout {bucket.layout} is newer than this version knows ({KNOWN_LAYOUTS[-1]})"
        diffs = [
            f"{f.name} {getattr(bucket, f.name)!r} (this store: {getattr(self, f.name)!r})"
            for f in fields(self)
            if f.name != "layout" and getattr(bucket, f.name) != getattr(self, f.name)
        ]
        return "the bucket was written with " + ", ".join(diffs) if diffs else None
