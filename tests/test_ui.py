"""The dashboard (``kv-chunk-fs ui``) in a real headless Chromium against a real mount.

The mount is filled with llama-server-shaped saves (tests/test_llama_shaped.py): two conversations
of two turns on one system prompt, plus one on another. Screenshots of every page go to
``BASETEMP/ui-screenshots`` (printed; ``KVCFS_UI_SHOTS=DIR`` to choose). The 10,000-snapshot test
measures page loads and prints them; it asserts nothing about time.

Needs ``chromium`` and ``chromium-driver`` (Debian packages) and ``selenium``; skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SRC, Mount
from test_llama_shaped import SPEC, SYSTEM, proxy_save

from e2e import ggsq
from kvchunkfs.service.apiclient import DaemonClient

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service as ChromeService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TOKEN = "ui-test-token"
ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)), reason="needs chromium and chromium-driver"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ui:
    """A ``kv-chunk-fs ui`` process."""

    proc: subprocess.Popen[bytes]
    url: str
    token_url: str  # what ``kv-chunk-fs ui`` printed: the URL carrying this run's token ("" if configured)

    def login(self, driver: WebDriver) -> None:
        """Open the printed URL once, as a user would: the page keeps the token for the tab."""
        driver.get(self.token_url)
        wait(driver, lambda d: "token=" not in d.current_url, what="token taken from the URL")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_ui(store: Path, log: Path, extra: list[str] | None = None) -> Ui:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "ui", "--store", str(store), "--listen", f"127.0.0.1:{port}",
           *(extra or [])]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/ui-config", timeout=2).status_code == 200:
                printed = re.search(r"dashboard on (http://\S+)", log.read_text())
                assert printed, log.read_text()
                return Ui(proc, url, printed.group(1) if "?token=" in printed.group(1) else "")
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"ui did not start: {log.read_text()}")
        time.sleep(0.1)


def chrome() -> WebDriver:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):  # fmt: skip
        opts.add_argument(arg)
    return webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=opts)


def wait(driver: WebDriver, cond: Callable[[WebDriver], Any], timeout: float = 20, what: str = "") -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=(WebDriverException,)).until(
        cond, what
    )


def save(mnt: Path, name: str, tokens: list[int]) -> None:
    (mnt / name).parent.mkdir(parents=True, exist_ok=True)
    proxy_save(mnt, name, tokens, SPEC)


def turns(seed: int, n: int, system: list[int] = SYSTEM) -> list[list[int]]:
    toks = system + ggsq.synthetic_tokens(200, seed=seed * 1000)
    out = [toks]
    for t in range(1, n):
        toks = toks + ggsq.synthetic_tokens(150, seed=seed * 1000 + t)
        out.append(toks)
    return out


@dataclass
class Env:
    mount: Mount
    ui: Ui
    driver: WebDriver
    shots: Path

    @property
    def mnt(self) -> Path:
        return self.mount.mnt

    def api(self, method: str, path: str, params: dict[str, str] | None = None) -> Any:
        return DaemonClient(self.mount.store).json(method, path, params)

    def open(self, page: str) -> None:
        self.driver.get(f"{self.ui.url}/#{page}")
        wait(self.driver, lambda d: d.find_element(By.ID, f"page-{page}").is_displayed(), what=page)

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def rows(self) -> list[str]:
        return self.js(
            "return [...document.querySelectorAll('#snap-table tbody tr[data-path]')].map(r => r.dataset.path)"
        )


def screenshot_dir(base: Path) -> Path:
    shots = Path(os.environ.get("KVCFS_UI_SHOTS", base / "ui-screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    return shots


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("ui")
    mount = Mount(base / "store", base / "mnt", base / "daemon.log")
    mount.start()
    ui = driver = None
    try:
        other = ggsq.synthetic_tokens(600, seed=77)
        for i, toks in enumerate(turns(1, 2)):
            save(mount.mnt, f"chat/conv1-t{i}", toks)
        for i, toks in enumerate(turns(2, 2)):
            save(mount.mnt, f"chat/conv2-t{i}", toks)
        save(mount.mnt, "misc/solo", turns(3, 1, other)[0])
        with open(mount.mnt / "chat/conv1-t0", "rb") as f:  # a restore: use count and restore timings
            while f.read(1 << 20):
                pass
        ui = start_ui(mount.store, base / "ui.log")
        driver = chrome()
        ui.login(driver)
        shots = screenshot_dir(Path(str(tmp_path_factory.getbasetemp())))
        print(f"\nscreenshots in {shots}")
        yield Env(mount, ui, driver, shots)
    finally:
        if driver is not None:
            driver.quit()
        if ui is not None:
            ui.stop()
        mount.stop()


# -- the tests ------------------------------------------------------------------------------------

OVERVIEW = {  # element id -> how to read the same figure from GET /stats
    "ov-snapshots": lambda s: s["snapshots"],
    "ov-logical": lambda s: s["logical_bytes"],
    "ov-stored": lambda s: s["stored_bytes"],
    "ov-dedup": lambda s: s["dedup_ratio"],
    "ov-packs": lambda s: s["packs"],
    "ov-pack-bytes": lambda s: s["pack_bytes"],
    "ov-dead": lambda s: max(0, s["pack_bytes"] - s["stored_bytes"]),
    "ov-garbage": lambda s: max(0, s["stored_bytes"] - s["referenced_bytes"]),
    "ov-saves": lambda s: s["counters"]["saves"],
    "ov-restores": lambda s: s["counters"]["restores"],
}


def test_overview_numbers_equal_stats(env: Env) -> None:
    env.open("overview")

    def shown_equals_stats(d: WebDriver) -> bool:
        stats = env.api("GET", "/stats")  # GC may change figures meanwhile: equal once settled
        shown = env.js("return Object.fromEntries(arguments[0].map("
                       "id => [id, document.getElementById(id).dataset.value]))", list(OVERVIEW))  # fmt: skip
        return all(shown[k] not in (None, "") and float(shown[k]) == float(f(stats)) for k, f in OVERVIEW.items())

    wait(env.driver, shown_equals_stats, what="overview equal to /stats")
    stats = env.api("GET", "/stats")
    assert stats["snapshots"] == 5 and stats["counters"]["saves"] >= 5 and stats["counters"]["restores"] >= 1
    wait(env.driver, lambda d: "p50" in d.find_element(By.ID, "ov-save-lat").text, what="save latency")
    assert "p50" in env.driver.find_element(By.ID, "ov-restore-lat").text
    assert env.driver.find_element(By.ID, "ov-errors").get_attribute("data-value") == "0"
    env.shot("overview")


def test_collect_now_runs_gc(env: Env) -> None:
    env.open("overview")
    runs = env.api("GET", "/stats")["gc"]["runs"]
    env.driver.find_element(By.ID, "gc-now").click()
    wait(env.driver, lambda d: "freed" in d.find_element(By.ID, "gc-result").text, what="gc result")
    assert env.api("GET", "/stats")["gc"]["runs"] > runs


def test_table_sorts_and_filters(env: Env) -> None:
    env.open("snapshots")
    wait(env.driver, lambda d: len(env.rows()) == 5, what="5 rows")
    assert env.rows() == sorted(env.rows())  # by path
    env.driver.find_element(By.CSS_SELECTOR, "th[data-sort=size]").click()
    expected = [r["path"] for r in env.api("GET", "/snapshots", {"sort": "size", "order": "desc"})["snapshots"]]
    wait(env.driver, lambda d: env.rows() == expected, what="sorted by size, largest first")
    env.driver.find_element(By.CSS_SELECTOR, "th[data-sort=size]").click()
    wait(env.driver, lambda d: env.rows() == expected[::-1], what="sorted by size, smallest first")
    env.shot("snapshots")

    prefix = env.driver.find_element(By.ID, "f-prefix")
    prefix.send_keys("chat/conv2")
    env.driver.find_element(By.ID, "f-apply").click()
    wait(env.driver, lambda d: sorted(env.rows()) == ["chat/conv2-t0", "chat/conv2-t1"], what="prefix filter")
    prefix.clear()
    env.driver.find_element(By.ID, "f-apply").click()
    wait(env.driver, lambda d: len(env.rows()) == 5, what="filter cleared")


def test_labels_edited_and_filtered(env: Env) -> None:
    env.open("snapshots")
    wait(env.driver, lambda d: "misc/solo" in env.rows(), what="rows")
    env.driver.find_element(By.CSS_SELECTOR, "tr[data-path='misc/solo'] button[title='edit labels']").click()
    box = wait(env.driver, lambda d: d.find_element(By.ID, "labels-input"), what="label dialog")
    box.send_keys("model=qwen, team=ops")
    env.driver.find_element(By.ID, "dlg-ok").click()
    wait(env.driver, lambda d: "model=qwen" in d.find_element(By.CSS_SELECTOR, "tr[data-path='misc/solo']").text)
    assert os.getxattr(env.mnt / "misc/solo", "user.kvcfs.label.model") == b"qwen"  # on the file itself
    env.driver.find_element(By.ID, "f-label").send_keys("model=qwen")
    env.driver.find_element(By.ID, "f-apply").click()
    wait(env.driver, lambda d: env.rows() == ["misc/solo"], what="label filter")
    # removing a label in the dialog removes the xattr
    env.driver.find_element(By.CSS_SELECTOR, "tr[data-path='misc/solo'] button[title='edit labels']").click()
    box = wait(env.driver, lambda d: d.find_element(By.ID, "labels-input"), what="label dialog")
    box.clear()
    box.send_keys("model=qwen")
    env.driver.find_element(By.ID, "dlg-ok").click()
    wait(env.driver, lambda d: "team=ops" not in d.find_element(By.CSS_SELECTOR, "tr[data-path='misc/solo']").text)
    assert "user.kvcfs.label.team" not in os.listxattr(env.mnt / "misc/solo")
    env.driver.find_element(By.ID, "f-label").clear()
    env.driver.find_element(By.ID, "f-apply").click()


def test_selection_shows_what_deleting_frees_and_delete_removes_from_mount(env: Env) -> None:
    save(env.mnt, "tmp/doomed", turns(9, 1)[0])
    env.open("snapshots")
    wait(env.driver, lambda d: "tmp/doomed" in env.rows(), what="doomed row")
    pair = ["chat/conv1-t0", "chat/conv1-t1"]
    for path in pair:
        env.driver.find_element(By.CSS_SELECTOR, f"tr[data-path='{path}'] input.sel").click()
    together = DaemonClient(env.mount.store)
    preview = json.loads(together.forward("POST", "/deletion-preview", json.dumps({"paths": pair}).encode(),
                                          "application/json")[2])  # fmt: skip
    info = env.driver.find_element(By.ID, "sel-info")
    wait(env.driver, lambda d: info.get_attribute("data-freed") == str(preview["freed_bytes"]), what="freed bytes")
    rows = {r["path"]: r for r in env.api("GET", "/snapshots")["snapshots"]}
    assert preview["freed_bytes"] >= sum(rows[p]["unique_bytes"] for p in pair)  # turns share with each other
    env.shot("snapshots-selected")
    env.driver.find_element(By.ID, "sel-clear").click()

    env.driver.find_element(By.CSS_SELECTOR, "tr[data-path='tmp/doomed'] button[title='delete']").click()
    wait(env.driver, lambda d: d.find_element(By.ID, "dlg").is_displayed(), what="confirmation")
    assert "tmp/doomed" in env.driver.find_element(By.ID, "dlg-body").text
    env.shot("delete-confirm")
    env.driver.find_element(By.ID, "dlg-ok").click()
    wait(env.driver, lambda d: "tmp/doomed" not in env.rows(), what="row gone")
    assert not (env.mnt / "tmp/doomed").exists()


def test_tree_shows_the_shared_prefix(env: Env) -> None:
    env.open("tree")
    # The root's children: the two conversations on SYSTEM share >= its 1000 tokens; misc/solo is alone.
    rows = wait(env.driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#tree > .tnode > .tkids > .tnode > .trow"))
    shared = [(int(r.get_attribute("data-prefix")), int(r.get_attribute("data-shared"))) for r in rows]
    assert any(prefix >= len(SYSTEM) and n == 4 for prefix, n in shared), shared
    # Collapsed by default: the conversations' own branches are not drawn until expanded.
    assert not env.driver.find_elements(By.CSS_SELECTOR, "#tree .tkids .tkids .trow")
    node = next(r for r in rows if int(r.get_attribute("data-shared")) == 4)
    node.find_element(By.CSS_SELECTOR, ".tlabel").click()
    detail = env.driver.find_element(By.ID, "tree-detail")
    wait(env.driver, lambda d: "shared by 4" in detail.text.lower(), what="node detail")
    for path in ("chat/conv1-t0", "chat/conv1-t1", "chat/conv2-t0", "chat/conv2-t1"):
        assert path in detail.text
    node.find_element(By.CSS_SELECTOR, ".toggle").click()
    wait(env.driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#tree .tkids .tkids .trow"), what="expanded")
    env.shot("tree")


def test_a_change_elsewhere_keeps_the_tree_as_expanded(env: Env) -> None:
    """A restore (or a GC run) changes the dashboard's live counters, not the prefix tree: the tree
    stays as the user expanded it, the same nodes under the pointer."""
    env.open("tree")
    rows = wait(env.driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#tree > .tnode > .tkids > .tnode > .trow"))
    node = next(r for r in rows if int(r.get_attribute("data-shared")) == 4)
    node.find_element(By.CSS_SELECTOR, ".toggle").click()
    wait(env.driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#tree .tkids .tkids .trow"), what="expanded")
    env.js("document.querySelector('#tree').firstElementChild.dataset.mark = 'kept'")
    seen = env.js("return lastChange")
    (env.mnt / "chat" / "conv1-t0").read_bytes()  # a restore: the counters move
    wait(env.driver, lambda d: env.js("return lastChange") != seen, what="the change seen by a poll")
    status = "return document.querySelector('#status').textContent"
    shown = env.js(status)
    wait(env.driver, lambda d: env.js(status) != shown, what="the next poll")
    assert env.js("return document.querySelector('#tree').firstElementChild.dataset.mark") == "kept", "tree redrawn"
    assert env.driver.find_elements(By.CSS_SELECTOR, "#tree .tkids .tkids .trow"), "collapsed by the redraw"
    node.find_element(By.CSS_SELECTOR, ".tlabel").click()  # the same element: not stale


TIME_LABEL = re.compile(r"\d{2}:\d{2}(:\d{2})?")  # wall-clock ticks (a date before them over days)


def time_labels(env: Env) -> dict[str, list[str]]:
    """The x-axis tick labels each chart drew (uPlot keeps the last ones it drew)."""
    return env.js("return Object.fromEntries(Object.entries(charts).map(([id, c]) => [id, c.axes[0]._values]))")


def test_charts_and_logs_pages(env: Env) -> None:
    env.open("charts")
    wait(env.driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#page-charts canvas")) == 3, what="3 charts")
    history = env.api("GET", "/history")
    assert len(history["saves"]["time"]) >= 5 and len(history["restores"]["time"]) >= 1
    # Saves a moment apart: the time axis still reads as clock times, not ":57.150".
    labels = wait(env.driver, lambda d: (t := time_labels(env)) and all(t.values()) and t, what="axis labels")
    assert set(labels) == {"chart-bytes", "chart-durations", "chart-store"}
    for chart, ticks in labels.items():
        assert all(TIME_LABEL.fullmatch(tick) for tick in ticks), (chart, ticks)
    for note in ("chart-bytes-note", "chart-durations-note", "chart-store-note"):
        assert not env.driver.find_element(By.ID, note).is_displayed(), "a chart with data has no empty note"
    env.shot("charts")
    env.open("logs")
    wait(env.driver, lambda d: "mounted" in d.find_element(By.ID, "log-table").text, what="log lines")
    table = env.driver.find_element(By.ID, "log-table").text
    assert "recovery: " in table and "snapshots checked" in table, "the mount's recovery summary"
    # A save's line names the file where its store finds it: renamed from NAME.tmp by then, or not yet.
    saved = re.search(r"saved chat/conv1-t0(\.tmp)?: ", table)
    assert saved and "restored chat/conv1-t0:" in table, "a line per save, restore"
    env.shot("logs")


def test_empty_charts_say_what_is_missing(env: Env, tmp_path: Path) -> None:
    """A fresh daemon: no restore yet is said on the chart that would show it, not a blank plot."""
    mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    mount.start()
    ui = start_ui(mount.store, tmp_path / "ui.log")
    try:
        ui.login(env.driver)
        env.driver.get(f"{ui.url}/#charts")
        shown = "return document.getElementById(arguments[0]).hidden ? null : document.getElementById(arguments[0])"
        text = shown + ".textContent"
        wait(env.driver, lambda d: env.js(text, "chart-durations-note") == "(no saves or restores yet)",
             what="no saves or restores yet")  # fmt: skip
        assert env.js(text, "chart-bytes-note") == "(no saves yet)"
        env.shot("charts-empty")
        save(mount.mnt, "only", turns(8, 1)[0])
        wait(env.driver, lambda d: env.js(text, "chart-durations-note") == "(no restores yet)", what="no restores yet")
        assert env.js(shown, "chart-bytes-note") is None, "the save is drawn"
        with open(mount.mnt / "only", "rb") as f:
            f.read()
        wait(env.driver, lambda d: env.js(shown, "chart-durations-note") is None, timeout=30, what="restore drawn")
    finally:
        env.js("sessionStorage.clear()")
        ui.stop()
        mount.stop()


def test_live_save_appears_without_reload(env: Env) -> None:
    env.open("overview")
    before = env.api("GET", "/stats")["snapshots"]
    cell = env.driver.find_element(By.ID, "ov-snapshots")
    wait(env.driver, lambda d: cell.get_attribute("data-value") == str(before))
    env.js("window.__marker = 1")  # gone if the page reloads
    save(env.mnt, "chat/live", turns(5, 1)[0])
    wait(env.driver, lambda d: cell.get_attribute("data-value") == str(before + 1), what="live count")
    assert env.js("return window.__marker") == 1  # no reload happened
    env.driver.find_element(By.CSS_SELECTOR, "a[data-page=snapshots]").click()
    wait(env.driver, lambda d: "chat/live" in env.rows(), what="new row")
    save(env.mnt, "chat/live2", turns(6, 1)[0])  # while the table is shown
    wait(env.driver, lambda d: "chat/live2" in env.rows(), what="row of a save made while looking")
    assert env.js("return window.__marker") == 1


def test_token_required_when_set(env: Env, tmp_path: Path) -> None:
    ui = start_ui(env.mount.store, tmp_path / "ui-token.log", ["--api-token", TOKEN])
    try:
        assert httpx.get(ui.url + "/api/stats").status_code == 401
        assert httpx.get(ui.url + "/api/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(ui.url + "/api/stats", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["snapshots"] >= 5
        # writes also need the custom header (no cross-site form posts), and a foreign Host is refused
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(ui.url + "/api/gc", headers=auth).status_code == 403
        assert httpx.get(ui.url + "/api/stats", headers={**auth, "Host": "evil.example:80"}).status_code == 421
        env.driver.get(ui.url + "/#overview")
        box = wait(env.driver, lambda d: d.find_element(By.ID, "token-input"), what="token prompt")
        assert env.driver.find_element(By.ID, "ov-snapshots").get_attribute("data-value") in (None, "")
        env.shot("token-prompt")
        box.send_keys("wrong")
        env.driver.find_element(By.ID, "dlg-ok").click()
        box = wait(env.driver, lambda d: d.find_element(By.ID, "token-input").is_displayed()
                   and d.find_element(By.ID, "token-input"), what="asked again")  # fmt: skip
        box.clear()
        box.send_keys(TOKEN)
        env.driver.find_element(By.ID, "dlg-ok").click()
        stats = env.api("GET", "/stats")
        cell = env.driver.find_element(By.ID, "ov-snapshots")
        wait(env.driver, lambda d: cell.get_attribute("data-value") == str(stats["snapshots"]), what="numbers")
    finally:
        env.js("sessionStorage.clear()")
        ui.stop()


def test_ui_refuses_network_listen_without_token(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    r = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "ui", "--store", str(tmp_path), "--listen",
                        "0.0.0.0:1"], env=env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 2 and "without a token" in r.stderr


# -- page load at 10,000 snapshots ------------------------------------------------------------------

LOAD_N = int(os.environ.get("KVCFS_UI_LOAD_N", "10000"))


def test_page_load_at_10000_snapshots(tmp_path: Path) -> None:
    """Build a store of LOAD_N llama-shaped snapshots (benchmarks/scale.py), mount it, and time each
    page in the browser from navigation to its data drawn. Printed, not asserted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale  # type: ignore[import-not-found]

    started = time.monotonic()
    scale.build(tmp_path / "store", LOAD_N)
    built = time.monotonic() - started
    mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    mount.start()
    ui = driver = None
    try:
        client = DaemonClient(mount.store)
        assert client.json("GET", "/stats")["snapshots"] == LOAD_N  # waits for the catalog's load
        ui = start_ui(mount.store, tmp_path / "ui.log")
        driver = chrome()
        ui.login(driver)
        shots = screenshot_dir(tmp_path.parent)
        results: dict[str, float] = {}
        ready = {
            "overview": "document.getElementById('ov-snapshots').dataset.value === arguments[0]"
                        " && document.getElementById('ov-save-lat').textContent !== ''",
            "snapshots": "document.querySelectorAll('#snap-table tbody tr[data-path]').length === 50",
            "tree": "document.querySelectorAll('#tree .trow').length > 1",
        }  # fmt: skip
        for page, cond in ready.items():
            for attempt in ("cold", "warm"):
                driver.get("about:blank")
                t0 = time.monotonic()
                driver.get(f"{ui.url}/#{page}")
                wait(driver, lambda d, c=cond: d.execute_script("return " + c, str(LOAD_N)), timeout=60, what=page)
                results[f"{page} ({attempt})"] = time.monotonic() - t0
            nav = driver.execute_script("const n = performance.getEntriesByType('navigation')[0];"
                                        "return [n.domContentLoadedEventEnd, n.loadEventEnd]")  # fmt: skip
            results[f"{page} DOMContentLoaded / load event (warm)"] = nav[0] / 1000
            driver.save_screenshot(str(shots / f"scale-{page}.png"))
        driver.get(f"{ui.url}/#snapshots")
        wait(driver, lambda d: d.execute_script("return " + ready["snapshots"]), timeout=60)
        t0 = time.monotonic()
        driver.find_element(By.CSS_SELECTOR, "th[data-sort=unique_bytes]").click()
        wait(
            driver,
            lambda d: d.execute_script(
                "return document.querySelector('th[data-sort=unique_bytes]').classList.contains('sorted')"
                " && document.querySelectorAll('#snap-table tbody tr[data-path]').length === 50"
            ),
            timeout=60,
        )
        results["snapshots: sort by unique bytes (server-side, all rows)"] = time.monotonic() - t0
        print(f"\nstore of {LOAD_N} snapshots built in {built:.1f}s; page loads in headless Chromium:")
        for name, seconds in results.items():
            print(f"  {name:55s} {seconds * 1000:7.0f} ms")
        for path in ("/stats", "/snapshots?limit=50&offset=0&sort=path", "/prefix-tree", "/history"):
            print(f"  GET {path}: {len(client.request('GET', path)[2]) / 1024:.0f} KiB")
    finally:
        if driver is not None:
            driver.quit()
        if ui is not None:
            ui.stop()
        mount.stop()
