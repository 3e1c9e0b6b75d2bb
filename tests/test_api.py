"""The HTTP API against a real daemon serving a real mount (TCP with a token, and the unix socket)."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, read_direct, wait_closed, write_in_pieces
from prometheus_client.parser import text_string_to_metric_families

from kvchunkfs.config import Config
from kvchunkfs.file.files import Files
from kvchunkfs.format import index as idx
from kvchunkfs.service.api import Service, create_app
from kvchunkfs.service.prefixtree import build_tree, to_json
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository

MiB = 1 << 20
TOKEN = "t0ken-for-tests"
# Deterministic (no clock): the listing's score must equal this for every row.
SCORE = "unique_bytes + 1000 * use_count"
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Api:
    mount: Mount
    http: httpx.Client  # TCP, with the token
    port: int

    @property
    def mnt(self) -> Path:
        return self.mount.mnt

    @property
    def snapshots_dir(self) -> Path:
        return self.mount.store / "snapshots"

    def unix(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.mount.store / "api.sock"))
        return httpx.Client(transport=transport, base_url="http://kvcfs", timeout=60)

    def listing(self, **params: str) -> dict[str, dict]:
        r = self.http.get("/snapshots", params=params)
        assert r.status_code == 200, r.text
        return {row["path"]: row for row in r.json()["snapshots"]}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    port = free_port()
    mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    mount.start(extra=["--api-address", f"127.0.0.1:{port}", "--api-token", TOKEN, "--score", SCORE])
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    try:
        yield Api(mount, client, port)
    finally:
        client.close()
        mount.stop()
    assert "Traceback" not in mount.log(), mount.log()


def independent_share(snapshots_dir: Path) -> dict[str, tuple[int, int, int, int]]:
    """path -> (size, chunks, unique bytes, shared bytes), straight from the stubs' bytes."""
    distinct: dict[str, dict[bytes, int]] = {}
    sizes = {}
    for path in snapshots_dir.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        index = idx.decode(path.read_bytes())
        rel = path.relative_to(snapshots_dir).as_posix()
        sizes[rel] = (index.size, len(index.ids))
        distinct[rel] = {cid: index.ends[i] - (index.ends[i - 1] if i else 0) for i, cid in enumerate(index.ids)}
    refs = Counter(cid for chunks in distinct.values() for cid in chunks)
    out = {}
    for rel, chunks in distinct.items():
        unique = sum(n for cid, n in chunks.items() if refs[cid] == 1)
        shared = sum(n for cid, n in chunks.items() if refs[cid] > 1)
        out[rel] = (*sizes[rel], unique, shared)
    return out


def make_store(api: Api) -> dict[str, bytes]:
    """Snapshots sharing chunks in different ways."""
    base = rand_bytes(6 * MiB, 100)
    files = {
        "a": base + rand_bytes(2 * MiB, 101),
        "b": base + rand_bytes(3 * MiB, 102),
        "c": rand_bytes(4 * MiB, 103),
        "d": b"",
        "dir/e": base[: 3 * MiB],
    }
    files["d"] = files["c"]  # an exact copy: everything shared, nothing unique
    os.mkdir(api.mnt / "dir")
    for name, data in files.items():
        write_in_pieces(api.mnt / name, data, MiB)
    api.mount.ingested()  # the listing's figures come from the stubs, which ingestion writes
    return files


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    message = r.json()["error"]
    assert "Traceback" not in message
    for word in words:
        assert word in message, message


# -- listing -------------------------------------------------------------------------------------


def test_listing_matches_an_independent_computation_on_the_stubs(api: Api) -> None:
    files = make_store(api)
    os.setxattr(api.mnt / "a", "user.kvcfs.label.model", b"qwen")
    os.setxattr(api.mnt / "b", "user.kvcfs.label.model", b"llama")
    os.setxattr(api.mnt / "b", "user.kvcfs.label.user", b"ann")
    for _ in range(2):
        assert (api.mnt / "b").read_bytes() == files["b"]  # two restores
        wait_closed(api.mount)  # a reopen while the content lingers would be part of the same restore
    rows = api.listing()
    expected = independent_share(api.snapshots_dir)
    assert set(rows) == set(files) == set(expected)
    for path, (size, chunks, unique, shared) in expected.items():
        row = rows[path]
        assert (row["size"], row["chunks"], row["unique_bytes"], row["shared_bytes"]) == (size, chunks, unique, shared)
        assert row["size"] == len(files[path]) == (api.mnt / path).stat().st_size
        assert row["score"] == pytest.approx(row["unique_bytes"] + 1000 * row["use_count"])
        assert row["created"] == pytest.approx(float(os.getxattr(api.mnt / path, stubs.CREATED)))
    # The figures mean what they should, not just agree with each other.
    assert rows["c"]["unique_bytes"] == rows["d"]["unique_bytes"] == 0
    assert rows["c"]["shared_bytes"] == 4 * MiB
    assert rows["a"]["unique_bytes"] > MiB and rows["a"]["shared_bytes"] > 5 * MiB
    assert rows["dir/e"]["unique_bytes"] < 256 * 1024, "a prefix of a shared base is almost all shared"
    assert rows["b"]["use_count"] == 2 and rows["b"]["last_use"] is not None
    assert rows["a"]["use_count"] == 0 and rows["a"]["last_use"] is None
    assert rows["b"]["labels"] == {"model": "llama", "user": "ann"}
    # One snapshot by path.
    r = api.http.get("/snapshots/dir/e")
    assert r.status_code == 200 and r.json() == {**rows["dir/e"], "age_hours": r.json()["age_hours"],
                                                 "idle_hours": r.json()["idle_hours"]}  # fmt: skip


def test_sort_and_filter(api: Api) -> None:
    make_store(api)
    os.setxattr(api.mnt / "a", "user.kvcfs.label.model", b"qwen")
    os.setxattr(api.mnt / "c", "user.kvcfs.label.model", b"qwen")
    os.setxattr(api.mnt / "b", "user.kvcfs.label.model", b"llama")

    def paths(**params: str) -> list[str]:
        r = api.http.get("/snapshots", params=params)
        assert r.status_code == 200, r.text
        return [row["path"] for row in r.json()["snapshots"]]

    assert paths() == ["a", "b", "c", "d", "dir/e"]
    assert paths(sort="size") == ["dir/e", "c", "d", "a", "b"]
    assert paths(sort="-size") == paths(sort="size", order="desc") == ["b", "a", "d", "c", "dir/e"]
    by_unique = api.listing()
    assert paths(sort="-unique_bytes")[0] == max(by_unique, key=lambda p: by_unique[p]["unique_bytes"])
    assert paths(**{"label.model": "qwen"}) == ["a", "c"]
    assert paths(has_label="model", sort="label.model") == ["b", "a", "c"]
    assert paths(min_size="5MiB") == ["a", "b"]
    assert paths(min_size=str(4 * MiB), max_size="4MiB") == ["c", "d"]
    assert paths(prefix="dir/") == ["dir/e"]
    assert paths(sort="-size", limit="2") == ["b", "a"]
    assert paths(max_unique_bytes="0") == ["c", "d"]


def test_bad_requests_get_4xx_with_a_message(api: Api) -> None:
    make_store(api)
    h = api.http
    assert_error(h.get("/snapshots", params={"sort": "bogus"}), 400, "sort", "bogus")
    assert_error(h.get("/snapshots", params={"order": "sideways"}), 400, "order")
    assert_error(h.get("/snapshots", params={"min_size": "lots"}), 400, "min_size", "size")
    assert_error(h.get("/snapshots", params={"min_use_count": "nan"}), 400, "min_use_count")
    assert_error(h.get("/snapshots", params={"colour": "red"}), 400, "colour")
    assert_error(h.get("/snapshots", params={"limit": "-1"}), 400, "limit")
    assert_error(h.get("/snapshots?sort=size&sort=path"), 400, "more than once")
    assert_error(h.get("/logs", params={"level": "loud"}), 400, "loud")
    assert_error(h.get("/logs", params={"limit": "many"}), 400, "limit")
    assert_error(h.get("/prefix-tree", params={"format": "xml"}), 400, "format")
    assert_error(h.get("/stats", params={"x": "1"}), 400, "x")
    assert_error(h.get("/no/such/thing"), 404, "/no/such/thing")
    assert_error(h.get("/snapshots/zzz"), 404, "zzz")
    assert_error(h.put("/snapshots"), 405, "PUT")
    assert_error(h.post("/snapshots/a"), 405)
    assert_error(h.get("/gc"), 405)
    assert h.get("/snapshots").status_code == 200, "still serving"


# -- auth and listeners ------------------------------------------------------------------------------


def test_token_required_on_tcp_not_on_the_root_only_socket(api: Api) -> None:
    bare = httpx.Client(base_url=f"http://127.0.0.1:{api.port}", timeout=30)
    with bare:
        for path in ("/snapshots", "/metrics", "/logs", "/openapi.json", "/prefix-tree"):
            r = bare.get(path)
            assert_error(r, 401, "token")
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert_error(bare.post("/gc"), 401)
        assert_error(bare.delete("/snapshots/a"), 401)
        assert_error(bare.get("/snapshots", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(bare.get("/snapshots", headers={"Authorization": f"Basic {TOKEN}"}), 401)
        assert bare.get("/health").status_code == 200, "liveness needs no token"
    assert api.http.get("/snapshots").status_code == 200
    sock = api.mount.store / "api.sock"
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    with api.unix() as unix:
        assert unix.get("/snapshots").json() == {"count": 0, "total": 0, "snapshots": []}


def test_socket_removed_on_unmount_and_stale_socket_replaced(api: Api) -> None:
    sock = api.mount.store / "api.sock"
    api.mount.stop()
    assert not sock.exists()
    # A daemon killed with SIGKILL leaves its socket behind; the next start replaces it.
    api.mount.start()
    api.mount.kill()
    assert sock.exists()
    # Detach the dead mount here so start() waits for the new daemon's mount, not the corpse.
    subprocess.run(["fusermount3", "-u", "-z", str(api.mnt)], check=True)
    api.mount.start()
    with api.unix() as unix:
        assert unix.get("/health").json()["status"] == "ok"


def test_a_second_daemon_on_the_same_store_is_refused(api: Api, tmp_path: Path) -> None:
    other = tmp_path / "mnt2"
    other.mkdir()
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(api.mount.store), str(other)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert "another" in r.stderr and "Traceback" not in r.stderr
    with api.unix() as unix:
        assert unix.get("/health").status_code == 200, "the first daemon is unaffected"


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
        with pytest.raises(RuntimeError, match="daemon exited 2"):
            mount.start(extra=["--api-address", f"127.0.0.1:{port}", "--api-token", TOKEN])
    assert "cannot serve the API" in mount.log() and "Address already in use" in mount.log()
    assert "Traceback" not in mount.log()
    assert not (tmp_path / "store" / "api.sock").exists()


# -- delete ------------------------------------------------------------------------------------------


def test_delete_goes_through_the_mount(api: Api) -> None:
    files = make_store(api)
    before = api.listing()
    assert before["c"]["unique_bytes"] == 0
    with open(api.mnt / "d", "rb") as f:  # open while deleted: FUSE semantics keep it readable
        r = api.http.delete("/snapshots/d")
        assert r.status_code == 200 and r.json() == {"deleted": "d"}
        assert "d" not in os.listdir(api.mnt)
        assert not (api.snapshots_dir / "d").exists()
        assert f.read() == files["d"]
    after = api.listing()
    assert "d" not in after
    assert after["c"]["unique_bytes"] == 4 * MiB, "its twin's chunks are now unique"
    assert api.http.delete("/snapshots/dir/e").status_code == 200
    assert os.listdir(api.mnt / "dir") == []
    assert_error(api.http.delete("/snapshots/d"), 404, "d")
    assert_error(api.http.delete("/snapshots/dir"), 404, "directory")
    with api.unix() as unix:  # the CLI's path: same app, no token
        assert unix.delete("/snapshots/a").status_code == 200
    assert sorted(os.listdir(api.mnt)) == ["b", "c", "dir"]


def test_delete_cannot_escape_the_store(api: Api, tmp_path: Path) -> None:
    make_store(api)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"precious too")
    (api.snapshots_dir / "link").symlink_to(victim)
    (api.snapshots_dir / "linkdir").symlink_to(outside)
    (api.snapshots_dir / "dotdot").symlink_to("..")
    cases = {
        "/snapshots/%2E%2E/daemon.log": "'..'",
        "/snapshots/dir/%2E%2E/a": "'..'",
        "/snapshots/%2E%2E%2F%2E%2E%2Fvictim": "'..'",
        "/snapshots//etc/passwd": "absolute",
        "/snapshots/%2E/a": "'.'",
        "/snapshots/dir//e": "empty",
        "/snapshots/link": "symlink",
        "/snapshots/linkdir/f": "symlink",
        "/snapshots/dotdot/daemon.log": "symlink",
    }
    for url, word in cases.items():
        assert_error(api.http.delete(url), 400, word)
    assert_error(api.http.delete("/snapshots/a/x"), 404)
    assert victim.read_bytes() == b"precious" and (outside / "f").exists()
    assert (tmp_path / "daemon.log").exists() and (api.snapshots_dir / "a").exists()
    assert set(api.listing()) == {"a", "b", "c", "d", "dir/e"}, "symlinks are not snapshots"


# -- metrics and logs ------------------------------------------------------------------------------


def scrape(api: Api) -> dict[str, float]:
    r = api.http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) == {"le"} and sample.labels["le"] == "+Inf":
                out[sample.name] = sample.value
    return out


METRIC_NAMES = (
    "kvcfs_written_bytes_total",
    "kvcfs_new_bytes_total",
    "kvcfs_deduped_bytes_total",
    "kvcfs_predicted_bytes_total",
    "kvcfs_dedup_ratio",
    "kvcfs_saves_total",
    "kvcfs_restores_total",
    "kvcfs_save_duration_seconds_count",
    "kvcfs_save_duration_seconds_sum",
    "kvcfs_restore_duration_seconds_count",
    "kvcfs_restore_duration_seconds_sum",
    "kvcfs_chunks_read_total",
    "kvcfs_restores_to_memory_total",
    "kvcfs_restores_to_disk_total",
    "kvcfs_store_chunks",
    "kvcfs_store_bytes",
    "kvcfs_packs",
    "kvcfs_pack_file_bytes",
    "kvcfs_gc_runs_total",
    "kvcfs_gc_freed_bytes_total",
)


def test_metrics_names_and_movement(api: Api) -> None:
    m0 = scrape(api)
    missing = [n for n in METRIC_NAMES if n not in m0]
    assert not missing, missing
    assert m0["kvcfs_store_chunks"] == 0 and m0["kvcfs_packs"] == 0
    data = rand_bytes(6 * MiB, 200)
    write_in_pieces(api.mnt / "x", data, MiB)
    write_in_pieces(api.mnt / "y", data, MiB)  # all deduplicated
    api.mount.ingested()  # a save is counted once it is stored as chunks, behind the close
    m1 = scrape(api)
    assert m1["kvcfs_saves_total"] - m0["kvcfs_saves_total"] == 2
    assert m1["kvcfs_save_duration_seconds_count"] - m0["kvcfs_save_duration_seconds_count"] == 2
    assert m1["kvcfs_save_duration_seconds_sum"] > m0["kvcfs_save_duration_seconds_sum"]
    assert m1["kvcfs_new_bytes_total"] == len(data)
    assert m1["kvcfs_written_bytes_total"] == 2 * len(data)
    assert m1["kvcfs_dedup_ratio"] == pytest.approx(2.0)
    assert m1["kvcfs_saved_new_bytes_total"] == len(data), "the second save added nothing new"
    assert m1["kvcfs_predicted_bytes_total"] > len(data) // 2, "the second save followed the first's chunks"
    assert m1["kvcfs_store_bytes"] == len(data) and m1["kvcfs_store_chunks"] > 0
    assert m1["kvcfs_packs"] == 1 and len(data) < m1["kvcfs_pack_file_bytes"] < len(data) * 1.001  # + batch records
    # Without a hot tier every open puts the snapshot back from its chunks, so the chunk read
    # path's counters move (a hot copy or the staged save would be read whole instead).
    api.mount.remount([*api.mount.extra, "--hot-tier-size", "0"])
    m1 = scrape(api)  # a new daemon: its counters start again
    assert read_direct(api.mnt / "x") == data
    wait_closed(api.mount)  # a restore is counted at FUSE RELEASE, which close() does not wait for
    m2 = scrape(api)
    assert m2["kvcfs_restores_total"] - m1["kvcfs_restores_total"] == 1
    assert m2["kvcfs_restore_duration_seconds_count"] - m1["kvcfs_restore_duration_seconds_count"] == 1
    assert m2["kvcfs_restore_duration_seconds_sum"] > m1["kvcfs_restore_duration_seconds_sum"]
    assert m2["kvcfs_restored_bytes_total"] - m1["kvcfs_restored_bytes_total"] == len(data)
    assert m2["kvcfs_restores_to_memory_total"] - m1["kvcfs_restores_to_memory_total"] == 1
    assert m2["kvcfs_chunks_read_total"] > m1["kvcfs_chunks_read_total"]
    # Same chunks: the put-back reads them from the packs again (it keeps no chunk cache, so its
    # memory does not grow with the file).
    assert read_direct(api.mnt / "y") == data
    wait_closed(api.mount)
    m3 = scrape(api)
    assert m3["kvcfs_chunks_read_total"] > m2["kvcfs_chunks_read_total"]
    # Opening for writing is a save, not a restore.
    with open(api.mnt / "x", "r+b") as f:
        f.read(10)
    assert scrape(api)["kvcfs_restores_total"] == m3["kvcfs_restores_total"]


def test_logs(api: Api) -> None:
    r = api.http.get("/logs")
    assert r.status_code == 200
    messages = [line["message"] for line in r.json()["lines"]]
    assert any(m.startswith("mounted ") for m in messages), messages
    assert any(m.startswith("recovery: ") and "snapshots checked" in m for m in messages), "the mount's recovery"
    assert all({"time", "level", "logger", "message"} <= set(line) for line in r.json()["lines"])
    write_in_pieces(api.mnt / "bad", b"x" * 1000, 100)
    api.mount.ingested()  # or ingestion would replace the broken stub below with a good one
    (api.snapshots_dir / "bad").write_bytes(b"not an index")
    with pytest.raises(OSError):
        (api.mnt / "bad").read_bytes()
    errors = api.http.get("/logs", params={"level": "error"}).json()["lines"]
    assert errors and all(line["level"] in ("error", "critical") for line in errors)
    assert any("cannot open snapshot bad" in line["message"] for line in errors)
    last = api.http.get("/logs", params={"limit": "1"}).json()
    assert last["count"] == 1 and len(last["lines"]) == 1
    assert api.http.get("/logs", params={"limit": "0"}).json()["lines"] == []
    # The broken stub is listed with its error rather than failing the listing.
    assert "error" in api.listing()["bad"]


# -- prefix tree -----------------------------------------------------------------------------------

KV = rand_bytes(MiB, 300)


def plain_ggsq(tokens: list[int]) -> bytes:
    return struct.pack("<3I", 0x67677371, 4, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + KV


def packed_ggsq(tokens: list[int]) -> bytes:
    blob = struct.pack("<iII", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + struct.pack("<I", 0)
    return struct.pack("<3I", 0x67677371, 4, len(blob) // 4) + blob + KV


def test_prefix_tree_from_plain_and_packed_snapshots(api: Api) -> None:
    system = list(range(1000, 1000 + 30_000))  # a long shared system prompt: more than one chunk
    tokens = {
        "chat/one": system + [1, 2, 3],
        "chat/two": system + [1, 2, 3, 4, 5],
        "chat/three": system + [9] * 50,
        "other": [7, 7, 7],
    }
    os.mkdir(api.mnt / "chat")
    write_in_pieces(api.mnt / "chat/one", plain_ggsq(tokens["chat/one"]), MiB)
    write_in_pieces(api.mnt / "chat/two", packed_ggsq(tokens["chat/two"]), MiB)
    write_in_pieces(api.mnt / "chat/three", packed_ggsq(tokens["chat/three"]), MiB)
    write_in_pieces(api.mnt / "other", plain_ggsq(tokens["other"]), MiB)
    write_in_pieces(api.mnt / "junk", rand_bytes(100_000, 301), MiB)
    (api.mnt / "empty").write_bytes(b"")
    api.mount.ingested()  # the tree is the chunk store's: a save is in it once stored
    r = api.http.get("/prefix-tree")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tree"] == to_json(build_tree(tokens))
    assert body["snapshots"] == 4
    assert {s["path"] for s in body["skipped"]} == {"junk", "empty"}
    assert "magic" in {s["path"]: s["reason"] for s in body["skipped"]}["junk"]
    shared = max(body["tree"]["children"], key=lambda child: child["shared_count"])
    assert shared["prefix_tokens"] == len(system) and shared["shared_count"] == 3 and "shared_by" not in shared
    named = api.http.get("/prefix-tree", params={"shared_by": "true"}).json()["tree"]
    assert named == to_json(build_tree(tokens), shared_by=True)
    assert sorted(max(named["children"], key=lambda child: child["shared_count"])["shared_by"]) == [
        "chat/one",
        "chat/three",
        "chat/two",
    ]
    assert api.http.get("/prefix-tree", params={"prefix": "chat/"}).json()["tree"] == to_json(
        build_tree({k: v for k, v in tokens.items() if k.startswith("chat/")})
    )
    text = api.http.get("/prefix-tree", params={"format": "text"})
    assert text.headers["content-type"].startswith("text/plain")
    assert f"{len(system)} tokens shared by chat/one, chat/three, chat/two" in text.text
    assert "skipped junk" in text.text
    # Read through the chunks, not the mount: the tree is not a restore.
    assert all(row["use_count"] == 0 for row in api.listing().values())


# -- gc, stats, openapi ----------------------------------------------------------------------------


def wait_for_startup_gc(api: Api) -> None:
    """The daemon collects once at mount; wait for that so runs can be counted exactly."""
    deadline = time.monotonic() + 30
    while api.http.get("/stats").json()["gc"]["runs"] < 1:
        assert time.monotonic() < deadline, "no GC at mount"
        time.sleep(0.05)


def test_gc_endpoint(api: Api) -> None:
    files = make_store(api)
    wait_for_startup_gc(api)
    m0 = scrape(api)
    assert m0["kvcfs_gc_runs_total"] >= 1, "the run at mount counts too"
    for name in ("a", "b", "dir/e"):
        os.unlink(api.mnt / name)
    r = api.http.post("/gc")
    assert r.status_code == 200, r.text
    report = r.json()
    m1 = scrape(api)
    assert m1["kvcfs_gc_runs_total"] == m0["kvcfs_gc_runs_total"] + 1
    assert m1["kvcfs_gc_duration_seconds_count"] == m0["kvcfs_gc_duration_seconds_count"] + 1
    assert report["bytes_freed"] > 0
    assert m1["kvcfs_gc_freed_bytes_total"] - m0["kvcfs_gc_freed_bytes_total"] == report["bytes_freed"]
    assert m1["kvcfs_store_bytes"] == len(files["c"])
    assert api.http.get("/stats").json()["gc"]["last"]["bytes_freed"] == report["bytes_freed"]
    assert read_direct(api.mnt / "c") == files["c"]
    with api.unix() as unix:  # what `kv-chunk-fs gc` uses against a mounted store
        assert unix.post("/gc").json()["bytes_freed"] == 0


def test_stats(api: Api) -> None:
    files = make_store(api)
    r = api.http.get("/stats")
    assert r.status_code == 200
    s = r.json()
    expected = independent_share(api.snapshots_dir)
    distinct: dict[bytes, int] = {}
    for path in expected:
        index = idx.decode((api.snapshots_dir / path).read_bytes())
        distinct.update({cid: index.ends[i] - (index.ends[i - 1] if i else 0) for i, cid in enumerate(index.ids)})
    packs = list((api.mount.store / "packs").iterdir())
    assert s["snapshots"] == len(files)
    assert s["logical_bytes"] == sum(len(d) for d in files.values())
    assert s["referenced_bytes"] == s["stored_bytes"] == sum(distinct.values())
    assert s["chunks"] == len(distinct)
    assert s["packs"] == len(packs) and s["pack_bytes"] == sum(p.stat().st_size for p in packs)
    assert s["dedup_ratio"] == pytest.approx(s["logical_bytes"] / s["stored_bytes"], rel=1e-3)
    assert s["counters"]["saves"] == len(files)


def test_openapi_served_committed_and_complete(api: Api, tmp_path: Path) -> None:
    served = api.http.get("/openapi.json").json()
    committed = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert served == committed, "regenerate: python -m kvchunkfs.service.openapi > docs/openapi.json"
    assert served["openapi"].startswith("3.")
    described = {(path, method) for path, ops in served["paths"].items() for method in ops if method != "parameters"}
    # Exactly the app's routes are described.
    repo = Repository(tmp_path / "spare-store")
    files = Files(repo)
    try:
        app = create_app(Service(files, tmp_path / "spare-mnt", Config()))
    finally:
        files.close()
        repo.close()
    routes = {
        (route.path.replace(":path}", "}"), method.lower())
        for route in app.routes
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert routes == described
    for path, method in described:  # and the daemon routes each of them
        r = api.http.request(method.upper(), path.replace("{path}", "nope"))
        assert r.status_code != 405, (path, method)
        assert r.status_code != 404 or "no such endpoint" not in r.text, (path, method)


def test_the_description_and_the_daemon_agree_at_their_edges(api: Api) -> None:
    """Where they disagreed (tests/test_api_schema.py runs schemathesis over all of it): every
    secured operation documents 401, bodies allow no unknown field and the daemon refuses them,
    counts take any 18-digit number, booleans are true or false, and a 405 names every method."""
    make_store(api)
    served = api.http.get("/openapi.json").json()
    for path, ops in served["paths"].items():
        for method, op in ops.items():
            if method != "parameters" and op.get("security") != []:
                assert "401" in op["responses"], (method, path)
                assert (
                    api.http.request(method, path.replace("{path}", "a"), headers={"Authorization": ""}).status_code
                    == 401
                )
    bodies = {(path, method): op["requestBody"]["content"]["application/json"]["schema"]
              for path, ops in served["paths"].items() for method, op in ops.items()
              if isinstance(op, dict) and "requestBody" in op}  # fmt: skip
    assert set(bodies) == {("/snapshots/{path}", "patch"), ("/deletion-preview", "post"), ("/prefix-match", "post")}
    assert all(schema["additionalProperties"] is False for schema in bodies.values())
    h = api.http
    assert_error(h.patch("/snapshots/a", json={"labels": {"k": "v"}, "x": 1}), 400, "'x'")
    assert_error(h.post("/prefix-match", json={"tokens": [1], "x": 1}), 400, "'x'")
    assert_error(h.post("/deletion-preview", json={"paths": ["a"], "x": 1}), 400, "'x'")
    assert h.post("/prefix-match", json={"tokens": [1.0, 2], "limit": 3.0}).status_code == 200  # JSON integers
    limit = served["paths"]["/logs"]["get"]["parameters"][1]
    assert limit["name"] == "limit" and limit["schema"]["maximum"] == 10**18 - 1
    for value in ("1073741825", str(10**18 - 1)):
        r = h.get("/logs", params={"limit": value})
        assert r.status_code == 200 and 0 < r.json()["count"] <= 2000, r.text
    assert_error(h.get("/logs", params={"limit": str(10**18)}), 400, "limit")
    for value in ("", "1", "yes", "True"):
        assert_error(h.get("/prefix-tree", params={"shared_by": value}), 400, "shared_by")
        assert_error(h.post("/gc", params={"walk": value}), 400, "walk")
    assert h.get("/prefix-tree", params={"shared_by": "false"}).status_code == 200
    r = h.put("/snapshots/a")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE", "PATCH"}
    assert_error(h.get("/snapshots/dir"), 404, "directory")
    assert_error(h.get("/snapshots/" + "x" * 300), 404, "too long")
    assert_error(h.patch("/snapshots/a", json={"labels": {"é" * 101: "v"}}), 400, "bytes")


def test_big_answers_are_encoded_in_pieces_to_the_same_json() -> None:
    """Long lists and big tree nodes go through orjson a piece at a time (the FUSE thread gets the
    GIL between pieces); the bytes must parse to the same answer."""
    from kvchunkfs.service.api.encode import PIECE, _dumps
    from kvchunkfs.service.prefixtree import build_tree, to_json

    rows = [{"path": f"p{i}", "size": i, "labels": {"k": "v"}, "score": 0.5} for i in range(2 * PIECE + 7)]
    for answer in ({"count": len(rows), "snapshots": rows, "next": None}, {"snapshots": rows[:PIECE]},
                   {"empty": [], "n": 1}, {1: "non-str key"}, [1, 2]):  # fmt: skip
        assert json.loads(_dumps(answer)) == json.loads(json.dumps(answer))
    items = {f"s{i}": [1, 2, 3] + [i % 7, i % 11, i] for i in range(3 * PIECE)}
    tree = {"snapshots": len(items), "skipped": [], "tree": to_json(build_tree(items))}
    assert json.loads(_dumps(tree)) == tree
