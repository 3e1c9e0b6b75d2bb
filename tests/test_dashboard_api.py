"""What the dashboard added to the API (paging by offset, deletion preview, history) and the dashboard
server's guard and proxy, in process (no FUSE, no browser: tests/test_ui.py drives those)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_scale import _save, service  # noqa: F401 - the fixture

from kvchunkfs.service import dashboard
from kvchunkfs.service.api import Service, create_app
from kvchunkfs.service.history import History, percentiles


def _store(service: Service) -> None:  # noqa: F811
    rng = random.Random(5)
    for c in range(6):
        for t in range(3):
            keys = ["system"] + [f"c{c}.{j}" for j in range(t + 1)] + [f"own{c}.{t}.{rng.random()}"]
            _save(service.repo, f"d{c % 2}/conv{c}-t{t}", keys)


def test_offset_pages_cover_any_order(service: Service) -> None:  # noqa: F811
    _store(service)
    client = TestClient(create_app(service))
    for sort in ("size", "-unique_bytes", "path", "score"):
        full = client.get("/snapshots", params={"sort": sort, "prefix": "d1/"}).json()
        assert full["total"] == full["count"] == 9
        pages = []
        for offset in range(0, 12, 4):
            page = client.get("/snapshots", params={"sort": sort, "prefix": "d1/", "limit": "4",
                                                    "offset": str(offset)}).json()  # fmt: skip
            assert page["total"] == 9
            pages += [r["path"] for r in page["snapshots"]]
        assert pages == [r["path"] for r in full["snapshots"]]
    assert client.get("/snapshots", params={"offset": "x"}).status_code == 400
    assert client.get("/snapshots", params={"limit": "5"}).json()["total"] == 18  # the catalog's page path


def test_deletion_preview_counts_chunks_shared_only_inside_the_set(service: Service) -> None:  # noqa: F811
    _store(service)
    client = TestClient(create_app(service))
    rows = {r["path"]: r for r in client.get("/snapshots").json()["snapshots"]}
    conv = [f"d0/conv0-t{t}" for t in range(3)]
    one = client.post("/deletion-preview", json={"paths": conv[:1]}).json()
    assert one["freed_bytes"] == rows[conv[0]]["unique_bytes"]  # alone: its unique bytes
    together = client.post("/deletion-preview", json={"paths": [*conv, "nope"]}).json()
    # the conversation's own chunks (c0.*) are shared between its turns only: freed together
    assert together["freed_bytes"] > sum(rows[p]["unique_bytes"] for p in conv)
    assert together["snapshots"] == 3 and together["missing"] == ["nope"]
    everything = client.post("/deletion-preview", json={"paths": list(rows)}).json()
    assert everything["freed_bytes"] == service.live.referenced_bytes
    assert client.post("/deletion-preview", json={"paths": "x"}).status_code == 400
    assert client.post("/deletion-preview", content=b"{not json").status_code == 400


def test_label_patch_rejects_bad_requests(service: Service) -> None:  # noqa: F811
    _store(service)
    client = TestClient(create_app(service))
    url = "/snapshots/d0/conv0-t0"
    assert client.patch(url, json={"labels": {"": "x"}}).status_code == 400
    assert client.patch(url, json={"labels": {"k": 3}}).status_code == 400
    assert client.patch(url, json={"labels": {"k": "a\0b"}}).status_code == 400
    assert client.patch(url, json={"other": 1}).status_code == 400
    assert client.patch(url, content=b'{"labels": {"k": "\\ud800"}}').status_code == 400
    assert client.patch(url, json={"labels": {"k": "v" * 1025}}).status_code == 400
    assert client.patch("/snapshots/nope", json={"labels": {"k": "v"}}).status_code == 404


def test_history_records_saves_restores_and_gc(service: Service) -> None:  # noqa: F811
    assert service.metrics is not None
    for i in range(10):
        service.metrics.on_save(0.01 * (i + 1), 1000, 100 * i)
    service.metrics.on_restore(0.5, 1000)
    service.metrics.on_gc(0.2, {"bytes_freed": 42})
    h = TestClient(create_app(service)).get("/history").json()
    assert h["saves"]["new_bytes"] == [100.0 * i for i in range(10)]
    assert len(h["saves"]["store_bytes"]) == 10 and h["gc"]["bytes_freed"] == [42.0]
    assert h["latency"]["save"] == {"count": 10, "p50": 0.05, "p90": 0.09, "p99": 0.1}
    assert h["latency"]["restore"]["count"] == 1
    later = TestClient(create_app(service)).get("/history", params={"since": str(h["saves"]["time"][-1])}).json()
    assert later["saves"]["time"] == []


def test_history_is_bounded() -> None:
    h = History(capacity=3)
    for i in range(10):
        h.on_save(float(i), 1, 0)
    assert h.to_dict()["saves"]["seconds"] == [7.0, 8.0, 9.0]
    assert h.to_dict()["saves"]["store_bytes"] == [None] * 3  # unknown store size: null, not NaN
    assert percentiles([]) == {"count": 0, "p50": None, "p90": None, "p99": None}


# -- the dashboard server ----------------------------------------------------------------------------


def test_dashboard_serves_assets_and_guards_the_api(tmp_path: Path) -> None:
    app = dashboard.create_ui_app(tmp_path, token="s3cret")
    client = TestClient(app, base_url="http://127.0.0.1:8765")
    page = client.get("/")
    assert page.status_code == 200 and "app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in ("app.js", "style.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert client.get(f"/static/{asset}").status_code == 200, asset
    assert client.get("/ui-config").json()["token_required"] is True
    assert client.get("/api/stats").status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    no_daemon = client.get("/api/stats", headers=auth)
    assert no_daemon.status_code == 502 and "Is the store mounted" in no_daemon.json()["error"]
    assert client.get("/api/openapi.json", headers=auth).status_code == 404  # only what the pages use
    assert client.post("/api/gc", headers=auth).status_code == 403  # no X-KVCFS-UI: 1
    rebinding = TestClient(app, base_url="http://attacker.example:8765")
    assert rebinding.get("/").status_code == 421


def test_dashboard_proxies_to_the_daemon_socket(service: Service, tmp_path: Path) -> None:  # noqa: F811
    """The proxy against a real API server on the store's unix socket."""
    import threading

    import uvicorn

    from kvchunkfs.service.apiclient import socket_path

    _store(service)
    config = uvicorn.Config(create_app(service), uds=str(socket_path(service.repo.root)), log_config=None,
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        client = TestClient(dashboard.create_ui_app(service.repo.root, "t0ken"), base_url="http://localhost:9000",
                            headers={"Authorization": "Bearer t0ken"})  # fmt: skip
        for _ in range(200):  # 502 until the server listens
            r = client.get("/api/snapshots", params={"prefix": "d0/", "limit": "2", "offset": "1"})
            if r.status_code != 502:
                break
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["total"] == 9 and r.json()["count"] == 2
        preview = client.post("/api/deletion-preview", json={"paths": ["d0/conv0-t0"]}, headers={"X-KVCFS-UI": "1"})
        assert preview.status_code == 200 and preview.json()["snapshots"] == 1
        assert client.get("/api/snapshots", params={"sort": "bogus"}).status_code == 400  # errors pass through
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_dashboard_has_no_tokenless_mode() -> None:
    with pytest.raises(ValueError, match="always needs a token"):
        dashboard.create_ui_app(Path("/nonexistent"), "")
    assert dashboard.new_token() != dashboard.new_token() and len(dashboard.new_token()) >= 32


@pytest.mark.parametrize("family", ["127.0.0.1", "::1"])
def test_peer_uid_finds_the_owner_of_a_local_tcp_peer(family: str) -> None:
    import os
    import socket

    kind = socket.AF_INET6 if ":" in family else socket.AF_INET
    with socket.socket(kind) as server, socket.socket(kind) as client:
        server.bind((family, 0))
        server.listen(1)
        client.connect(server.getsockname()[:2])
        conn, _ = server.accept()
        with conn:
            peer, ours = client.getsockname(), server.getsockname()
            assert dashboard.peer_uid(peer[0], peer[1], ours[0], ours[1]) == os.getuid()
            assert dashboard.peer_uid(peer[0], peer[1] ^ 1, ours[0], ours[1]) is None  # no such socket
            scope = {"client": (peer[0], peer[1]), "server": (ours[0], ours[1])}
            assert dashboard.describe_client(scope) == f"dashboard client {peer[0]}:{peer[1]} uid {os.getuid()}"
    assert dashboard.describe_client({}) == "dashboard client (unknown)"


@pytest.mark.parametrize(
    ("header", "name"),
    [("127.0.0.1:8765", "127.0.0.1"), ("localhost", "localhost"), ("[::1]:9000", "::1"), ("a.b:1", "a.b")],
)
def test_host_name(header: str, name: str) -> None:
    assert dashboard.host_name(header) == name


def test_next_gc_due_counts_whole_intervals_past_skipped_timer_runs() -> None:
    from kvchunkfs.service.api.service import _next_due

    assert _next_due(None, 3600, 100.0) is None and _next_due(100.0, 0, 100.0) is None
    assert _next_due(1000.0, 3600, 2000.0) == 4600.0
    assert _next_due(1000.0, 3600, 4600.5) == 8200.0  # the timer run at 4600 was skipped
