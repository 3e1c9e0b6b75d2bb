"""The shared tier's bucket: object names and the S3 calls (boto3), nothing else.

Layout under ``s3://BUCKET/PREFIX`` (desync/casync-compatible, uncompressed, like ``export-store``)::

    PREFIX/chunks/<first 4 hex>/<64 hex>     one chunk, its SHA-256 id in hex
    PREFIX/index/<snapshot path>.caibx       a snapshot's index (the stub's content); its user
                                             metadata ``kvcfs-format`` says how its stream is read,
                                             ``kvcfs-file`` carries its file record (remoteindex.py)
    PREFIX/format                            the bucket's format (store/bucketformat.py), written once
    PREFIX/damaged/<64 hex>                  empty: a host fetched that chunk and it failed its id
    PREFIX/packs/<2 hex>/<64 hex>            packed layout: chunks back to back (store/remotepacks.py)
    PREFIX/packidx/<16 hex>-<64 hex>         packed layout: what some packs hold (writer's clock in µs, SHA-256)

Credentials and region come the usual boto3 way (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws/config``, instance roles); only the endpoint is a setting of ours.
A boto3 client is thread-safe; one is shared by all threads.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvchunkfs.store.layout import loose_chunk_name

INDEX_SUFFIX = ".caibx"
_PACKIDX_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{64}")
FORMAT_META = "kvcfs-format"  # user metadata of an index object: what its stream needs to be read
RECORD_META = "kvcfs-file"  # user metadata of an index object: its file record (store/remoteindex.py)
_INDEX_PIECE = 1 << 20  # bytes of an index object read at a time by ``fetch_index``


class RemoteError(OSError):
    """The bucket could not be reached or refused a request (an OSError: FUSE answers EIO)."""


class PreconditionFailed(RemoteError):
    """A conditional request's condition did not hold (the object exists, or changed)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # epoch seconds, the server's clock
    etag: str


def parse_remote(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix")."""
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


@dataclass(frozen=True)
class IndexObject:
    data: bytes
    etag: str
    stream: str | None  # the index's ``kvcfs-format`` metadata; None for one written before it existed
    record: str | None = None  # its ``kvcfs-file`` metadata; None for one written before it existed


class TooLarge(RemoteError):
    """An object is larger than what may be read into memory for it (never parsed)."""


class NotItsName(RemoteError):
    """An object named by a hash of its content whose content does not hash to it."""


@dataclass(frozen=True)
class ChunkHead:
    modified: float  # epoch seconds
    now: float  # the server's clock (boto3: the Date header) or this host's (obstore gives no headers)
    etag: str


def content_etag(data: bytes | memoryview) -> str:
    """The ETag S3 gives an object of these bytes put in one request without KMS (its MD5)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def plain_etag(etag: str) -> str:
    return etag.strip('"').lower()


@dataclass
class BucketCounters:
    chunk_gets: int = 0
    chunk_get_bytes: int = 0
    chunk_puts: int = 0
    chunk_put_bytes: int = 0
    index_gets: int = 0
    index_puts: int = 0
    lists: int = 0
    pack_puts: int = 0
    pack_put_bytes: int = 0
    pack_touches: int = 0
    range_gets: int = 0
    range_get_bytes: int = 0
    packidx_puts: int = 0
    packidx_gets: int = 0
    heads: int = 0

    def requests(self) -> int:
        """Every request counted (LISTs, GETs, PUTs, HEADs of chunks and packs, touches)."""
        return (self.chunk_gets + self.chunk_puts + self.index_gets + self.index_puts + self.lists + self.pack_puts
                + self.pack_touches + self.range_gets + self.packidx_puts + self.packidx_gets + self.heads)  # fmt: skip


class Bucket:
    def __init__(self, url: str, endpoint: str = "", client: Any = None) -> None:
        self.url = url
        self.name, prefix = parse_remote(url)
        self.prefix = f"{prefix}/" if prefix else ""
        own_client = client is None
        if client is None:
            try:  # here, not at the top: every command imports this module, few talk to S3
                import boto3
                import botocore.config
            except ImportError:
                raise RemoteError(5, "remote needs boto3: pip install 'kv-chunk-fs[s3]'") from None

            # A dead endpoint must not hold an upload worker or an open() for minutes: few, short
            # retries; the upload queue retries later anyway.
            config = botocore.config.Config(
                connect_timeout=3,
                read_timeout=30,
                retries={"max_attempts": 2, "mode": "standard"},
                max_pool_connections=64,
            )
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            session = boto3.session.Session()
            client = session.client(
                "s3",
                endpoint_url=endpoint or None,
                region_name=region or session.region_name or "us-east-1",
                config=config,
            )
        self.client = client
        # Chunk GETs, PUTs and HEADs (thousands per snapshot) go through obstore (Rust) when it is
        # installed: 3x boto3's rate of 64 KiB GETs on loopback SeaweedFS (docs/design.md).
        self._data = _obstore(self.name, endpoint, region_name(client)) if own_client else None
        self.counters = BucketCounters()
        self._count_lock = threading.Lock()  # leaf lock, list operations only

    def _count(self, **amounts: int) -> None:
        with self._count_lock:
            for name, n in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    # -- names ------------------------------------------------------------------------------

    def chunk_key(self, cid: bytes) -> str:
        return f"{self.prefix}chunks/{loose_chunk_name(cid)}"

    def index_key(self, rel: str) -> str:
        return f"{self.prefix}index/{rel}{INDEX_SUFFIX}"

    def rel_of_index(self, key: str) -> str | None:
        base = f"{self.prefix}index/"
        if not key.startswith(base) or not key.endswith(INDEX_SUFFIX):
            return None
        rel = key[len(base) : -len(INDEX_SUFFIX)]
        parts = rel.split("/")
        return rel if rel and ".." not in parts and "." not in parts and "" not in parts and "\0" not in rel else None

    def cid_of_chunk(self, key: str) -> bytes | None:
        name = key.rpartition("/")[2]
        try:
            cid = bytes.fromhex(name)
        except ValueError:
            return None
        return cid if len(cid) == 32 and key == self.chunk_key(cid) else None

    # -- calls ------------------------------------------------------------------------------

    def put_chunk(self, cid: bytes, data: bytes | memoryview) -> str:
        """Put the chunk; its ETag as the server computed it ("" if none came back)."""
        key = self.chunk_key(cid)
        if self._data is not None:
            etag = self._fast("put", key, bytes(data)).get("e_tag") or ""
        else:
            etag = self._call("put_object", Key=key, Body=bytes(data)).get("ETag", "")
        self._count(chunk_puts=1, chunk_put_bytes=len(data))
        return plain_etag(str(etag))

    def get_chunk(self, cid: bytes) -> bytes:
        key = self.chunk_key(cid)
        data = bytes(self._fast("get", key).bytes()) if self._data is not None else self._get(key)
        self._count(chunk_gets=1, chunk_get_bytes=len(data))
        return data

    def touch_chunk(self, cid: bytes) -> None:
        """Give an existing chunk a new modification time (a server-side copy onto itself)."""
        key = self.chunk_key(cid)
        self._call("copy_object", Key=key, CopySource={"Bucket": self.name, "Key": key}, MetadataDirective="REPLACE")

    def head_chunk(self, cid: bytes) -> tuple[float, float] | None:
        """(modified, now) of a chunk, or None if the bucket lacks it."""
        head = self.stat_chunk(cid)
        return None if head is None else (head.modified, head.now)

    def stat_chunk(self, cid: bytes) -> ChunkHead | None:
        """A chunk's HEAD, or None if the bucket lacks it."""
        key = self.chunk_key(cid)
        try:
            if self._data is not None:
                meta = self._fast("head", key)
                return ChunkHead(meta["last_modified"].timestamp(), time.time(), plain_etag(meta.get("e_tag") or ""))
            r = self._call("head_object", Key=key)
        except FileNotFoundError:
            return None
        finally:
            self._count(heads=1)
        return ChunkHead(r["LastModified"].timestamp(), _server_now(r), plain_etag(str(r.get("ETag", ""))))

    # -- the packed layout ----------------------------------------------------------------------

    def pack_key(self, pack: bytes) -> str:
        h = pack.hex()
        return f"{self.prefix}packs/{h[:2]}/{h}"

    def packidx_key(self, name: str) -> str:
        return f"{self.prefix}packidx/{name}"

    def put_pack(self, pack: bytes, data: bytes) -> None:
        """Put a pack; RemoteError unless the server's ETag is the bytes' MD5 (or not an MD5 at all)."""
        key = self.pack_key(pack)
        if self._data is not None:
            etag = self._fast("put", key, data).get("e_tag") or ""
        else:
            etag = self._call("put_object", Key=key, Body=data).get("ETag", "")
        etag = plain_etag(str(etag))
        if len(etag) == 32 and etag != content_etag(data) and "-" not in etag:
            raise RemoteError(5, f"{self.url}: pack {pack.hex()} stored with ETag {etag}, not its content's")
        self._count(pack_puts=1, pack_put_bytes=len(data))

    def touch_pack(self, pack: bytes) -> bool:
        """A new modification time for a pack (server-side copy onto itself); False if it is gone."""
        key = self.pack_key(pack)
        try:
            self._call("copy_object", Key=key, CopySource={"Bucket": self.name, "Key": key},
                       MetadataDirective="REPLACE")  # fmt: skip
        except FileNotFoundError:
            return False
        self._count(pack_touches=1)
        return True

    def get_ranges(self, pack: bytes, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Byte ranges [start, end) of a pack, each one GET (parallel callers coalesce first);
        FileNotFoundError if the pack is gone. Views of the responses, not copies (a restore
        fetches hundreds of MB: a copy under the interpreter lock costs as much as the hashing)."""
        key = self.pack_key(pack)
        if self._data is not None:
            starts, ends = [a for a, _ in ranges], [b for _, b in ranges]
            out = [memoryview(b) for b in self._fast("get_ranges", key, starts=starts, ends=ends)]
        else:
            out = [memoryview(self._get(key, Range=f"bytes={a}-{b - 1}")) for a, b in ranges]
        for (a, b), got in zip(ranges, out, strict=True):
            if len(got) != b - a:
                raise RemoteError(5, f"{self.url}: pack {pack.hex()}: {len(got)} bytes for range {a}-{b}")
        self._count(range_gets=len(ranges), range_get_bytes=sum(b - a for a, b in ranges))
        return out

    def put_packidx(self, data: bytes) -> str:
        """Put a pack index; its name: this host's clock (listings from a time on find it) and its SHA-256."""
        name = f"{int(time.time() * 1e6):016x}-{hashlib.sha256(data).hexdigest()}"
        self._call("put_object", Key=self.packidx_key(name), Body=data)
        self._count(packidx_puts=1)
        return name

    def get_packidx(self, name: str, limit: int) -> bytes:
        """A pack index's content (checked against its name; TooLarge past ``limit`` bytes)."""
        r = self._call("get_object", Key=self.packidx_key(name))
        body = r["Body"]
        try:
            if int(r.get("ContentLength", -1)) > limit:
                raise TooLarge(27, f"{self.url}: pack index {name} is larger than a pack index may be")
            data = bytes(body.read(limit + 1))
        finally:
            body.close()
        if len(data) > limit:
            raise TooLarge(27, f"{self.url}: pack index {name} is larger than a pack index may be")
        self._count(packidx_gets=1)
        if hashlib.sha256(data).hexdigest() != name[17:]:
            raise NotItsName(5, f"{self.url}: pack index {name}: its content is not its name's")
        return data

    def list_packidx(self, since_us: int | None = None) -> dict[str, ObjectInfo]:
        """Pack indexes by name; with ``since_us``, only those named from that time on (one LIST
        page per 1000 new ones, not per 1000 in the bucket)."""
        base = f"{self.prefix}packidx/"
        after = f"{base}{since_us:016x}" if since_us is not None else None
        out = {}
        for info, _ in self._list(base, after):
            name = info.key[len(base) :]
            if _PACKIDX_NAME.fullmatch(name):
                out[name] = info
        return out

    def list_packs(self) -> tuple[dict[bytes, ObjectInfo], float]:
        """Every pack, and the server's clock when the listing began."""

        def name_of(key: str) -> bytes | None:
            name = _hex_name(key)
            return name if name is not None and key == self.pack_key(name) else None

        return self._list_named(f"{self.prefix}packs/", name_of)

    def head_pack(self, pack: bytes) -> tuple[float, float] | None:
        """(modified, now by the server's clock) of a pack, or None if it is gone."""
        try:
            r = self._call("head_object", Key=self.pack_key(pack))
        except FileNotFoundError:
            return None
        self._count(heads=1)
        return r["LastModified"].timestamp(), _server_now(r)

    def delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            r = self._call("delete_objects", Delete={"Objects": batch, "Quiet": True})
            if r.get("Errors"):
                raise RemoteError(f"deleting from {self.url}: {r['Errors'][0]}")

    def _list_hex(self, prefix: str) -> dict[bytes, ObjectInfo]:
        out = {}
        for info, _ in self._list(prefix):
            name = _hex_name(info.key)
            if name is not None:
                out[name] = info
        return out

    # -- damage reports: a host that fetched a chunk failing its id says so; one that has it heals it

    def damaged_key(self, cid: bytes) -> str:
        return f"{self.prefix}damaged/{cid.hex()}"

    def report_damaged(self, cid: bytes) -> None:
        self._call("put_object", Key=self.damaged_key(cid), Body=b"")

    def clear_damaged(self, cid: bytes) -> None:
        self._call("delete_object", Key=self.damaged_key(cid))

    def list_damaged(self) -> set[bytes]:
        return set(self._list_hex(f"{self.prefix}damaged/"))

    def _fast(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """One obstore call; a missing object is FileNotFoundError, any other failure RemoteError."""
        import obstore
        import obstore.exceptions

        try:
            return getattr(obstore, op)(self._data, *args, **kwargs)
        except (FileNotFoundError, obstore.exceptions.NotFoundError):
            raise FileNotFoundError(2, f"{self.url}: no {args[0]}") from None
        except (obstore.exceptions.BaseError, OSError) as e:
            first = str(e).partition("\n")[0]  # the rest is a multi-line debug dump
            raise RemoteError(5, f"{self.url}: {op} failed: {first}") from None

    def put_index(self, rel: str, data: bytes, stream: str = "", record: str = "") -> str:
        """Replace the index object (atomic for readers); returns its ETag. ``stream`` (metadata)
        says what reading it needs (``BucketFormat.stream``), ``record`` carries its file record
        (``remoteindex.record_meta``): both put with the bytes in one request."""
        meta = {k: v for k, v in ((FORMAT_META, stream), (RECORD_META, record)) if v}
        r = self._call("put_object", Key=self.index_key(rel), Body=data, **({"Metadata": meta} if meta else {}))
        self._count(index_puts=1)
        return str(r.get("ETag", ""))

    def read_index(self, rel: str, limit: int | None = None) -> IndexObject:
        """The index object; FileNotFoundError if there is none, TooLarge (nothing read past the
        headers) if it is over ``limit`` bytes."""
        pieces: list[bytes] = []
        obj = self.fetch_index(rel, pieces.append, limit)
        return IndexObject(pieces[0] if len(pieces) == 1 else b"".join(pieces), obj.etag, obj.stream, obj.record)

    def fetch_index(self, rel: str, sink: Callable[[bytes], None], limit: int | None = None) -> IndexObject:
        """The index object handed to ``sink`` a piece at a time as it arrives (never held whole);
        its ETag and metadata (``data`` empty). FileNotFoundError if there is none, TooLarge if it
        is over ``limit`` bytes (nothing read past the headers, or no more than ``limit`` + 1 MiB
        from a server that sent no length, or a wrong one)."""
        r = self._call("get_object", Key=self.index_key(rel))
        body = r["Body"]
        try:
            size = int(r.get("ContentLength", -1))
            if limit is not None and size > limit:
                raise TooLarge(27, f"{self.url}: index {rel} has {size} bytes, more than an index may ({limit})")
            got = 0
            while piece := body.read(_INDEX_PIECE):
                got += len(piece)
                if limit is not None and got > limit:
                    raise TooLarge(27, f"{self.url}: index {rel} is larger than an index may be ({limit} bytes)")
                sink(piece)
        finally:
            body.close()
        self._count(index_gets=1)
        meta = r.get("Metadata", {})
        return IndexObject(b"", str(r.get("ETag", "")), meta.get(FORMAT_META), meta.get(RECORD_META))

    def get_index(self, rel: str, limit: int | None = None) -> tuple[bytes, str]:
        """(content, ETag); FileNotFoundError if there is none."""
        obj = self.read_index(rel, limit)
        return obj.data, obj.etag

    def format_key(self) -> str:
        return f"{self.prefix}format"

    def get_format(self, limit: int) -> bytes | None:
        """The bucket's format object, or None if it has none."""
        try:
            r = self._call("get_object", Key=self.format_key())
        except FileNotFoundError:
            return None
        data = bytes(r["Body"].read(limit + 1))
        if len(data) > limit:
            raise TooLarge(27, f"{self.url}: {self.format_key()} is larger than a format object may be")
        return data

    def create_format(self, data: bytes) -> bool:
        """Put the format object if the bucket has none (a conditional PUT: of two hosts racing,
        one wins). False if one was there. A server that ignores the condition is caught by the
        caller reading the object back."""
        try:
            self._call("put_object", Key=self.format_key(), Body=data, IfNoneMatch="*")
        except PreconditionFailed:
            return False
        return True

    def head_index(self, rel: str) -> str | None:
        try:
            return str(self._call("head_object", Key=self.index_key(rel)).get("ETag", ""))
        except FileNotFoundError:
            return None

    def delete_index(self, rel: str) -> None:
        self._call("delete_object", Key=self.index_key(rel))

    def delete_chunks(self, cids: list[bytes]) -> None:
        self.delete_keys([self.chunk_key(c) for c in cids])

    def list_indexes(self) -> dict[str, ObjectInfo]:
        """Every index in the bucket by snapshot path."""
        out = {}
        for info, _ in self._list(f"{self.prefix}index/"):
            rel = self.rel_of_index(info.key)
            if rel is not None:
                out[rel] = info
        return out

    def list_chunks(self) -> tuple[dict[bytes, ObjectInfo], float]:
        """Every chunk in the bucket, and the server's clock when the listing began."""
        return self._list_named(f"{self.prefix}chunks/", self.cid_of_chunk)

    def _list_named(self, prefix: str, name_of: Callable[[str], bytes | None]) -> tuple[dict[bytes, ObjectInfo], float]:
        """Objects under ``prefix`` by the name ``name_of`` gives their key (None: skipped), and the
        server's clock when the listing began."""
        out: dict[bytes, ObjectInfo] = {}
        now = 0.0
        for info, server_now in self._list(prefix):
            now = now or server_now
            name = name_of(info.key)
            if name is not None:
                out[name] = info
        return out, now or time.time()

    def _list(self, prefix: str, start_after: str | None = None) -> Iterator[tuple[ObjectInfo, float]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if start_after:
                kwargs["StartAfter"] = start_after
            if token:
                kwargs["ContinuationToken"] = token
            r = self._call("list_objects_v2", **kwargs)
            self._count(lists=1)
            now = _server_now(r)
            for o in r.get("Contents", []):
                yield ObjectInfo(o["Key"], o["Size"], o["LastModified"].timestamp(), str(o.get("ETag", ""))), now
            if not r.get("IsTruncated"):
                return
            token = r["NextContinuationToken"]

    def _get(self, key: str, **kwargs: Any) -> bytes:
        return bytes(self._call("get_object", Key=key, **kwargs)["Body"].read())

    def _call(self, op: str, **kwargs: Any) -> Any:
        """One S3 call; a missing object is FileNotFoundError, any other failure RemoteError."""
        import botocore.exceptions

        try:
            return getattr(self.client, op)(Bucket=self.name, **kwargs)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(2, f"{self.url}: no {kwargs.get('Key', '')}") from None
            if code in ("412", "PreconditionFailed", "ConditionalRequestConflict"):
                raise PreconditionFailed(17, f"{self.url}: {op} {kwargs.get('Key', '')}: precondition failed") from None
            raise RemoteError(5, f"{self.url}: {op} failed: {e}") from None
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise RemoteError(5, f"{self.url}: {op} failed: {e}") from None


def _hex_name(key: str) -> bytes | None:
    """The 32-byte name a key ends with (``.../<64 hex>``), or None."""
    with contextlib.suppress(ValueError):
        name = bytes.fromhex(key.rpartition("/")[2])
        if len(name) == 32:
            return name
    return None


def region_name(client: Any) -> str:
    return str(getattr(getattr(client, "meta", None), "region_name", None) or "us-east-1")


def _obstore(bucket: str, endpoint: str, region: str) -> Any:
    """An obstore S3Store with boto3's credentials (env, shared config, roles; refreshed), or None."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
        from obstore.store import S3Store
    except ImportError:
        return None
    options: Any = {"timeout": "30s", "connect_timeout": "3s"}  # obstore.store.ClientConfig
    if endpoint.startswith("http://"):
        options["allow_http"] = True
    kwargs: dict[str, Any] = {"endpoint": endpoint} if endpoint else {}
    # obstore's default retries for up to 3 minutes: a dead bucket would hold an upload worker, an
    # open() and the unmount that long. Two quick retries, like the boto3 client.
    retry: Any = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=10)}
    return S3Store(bucket, region=region, credential_provider=Boto3CredentialProvider(boto3.session.Session()),
                   client_options=options, retry_config=retry, **kwargs)  # fmt: skip


def _server_now(response: dict[str, Any]) -> float:
    """The server's clock from a response's Date header (grace ages are measured on one clock)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        try:
            return email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            pass
    return time.time()
