"""Which small charting library loads and draws fastest in headless Chromium (for the dashboard's charts).

For each library one self-contained HTML page is written (library inlined in a ``<script>``, data generated
in the page by the same deterministic JS before it) drawing 3 line series x 5,000 points on 900x300 px,
no animation. Each page load uses a fresh headless Chromium (options as tests/test_ui.py) so no V8
compilation cache carries over; loads are interleaved across libraries, rotating the order each round.

Times are ``performance.now()`` (ms from navigation start):
  draw  -- when the library reports the chart drawn (uPlot ``draw`` hook, Chart.js ``afterRender`` plugin
           hook with animation off, ECharts ``rendered`` event / return of ``setOption`` with animation off);
  parse -- right after the library's ``<script>`` has been parsed and evaluated;
  script only -- that minus the time just before the library's ``<script>`` (its own parse+eval);
  build -- draw minus the time just before the chart is constructed (the library's own drawing work).
x is unix time: uPlot's default time axis (as the dashboard), ECharts ``time`` axis, Chart.js ``linear``
(its ``time`` scale needs a separate date adapter). Chart.js gets ``parsing: false`` and ``{x, y}`` points.

    python benchmarks/chartlibs.py --chartjs .../chart.js/dist/chart.umd.js \\
        --echarts .../echarts/dist/echarts.min.js [--loads 7]

Needs ``chromium``, ``chromium-driver`` and ``selenium``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import statistics
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
UI = ROOT / "src" / "kvchunkfs" / "service" / "ui"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

DATA_JS = """
const N = 5000, T0 = 1767225600, COLORS = ["#d9534f", "#5cb85c", "#337ab7"];
let seed = 42;
function rnd() { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; }
const XS = Array.from({length: N}, (_, i) => T0 + i * 10);
const YS = [0, 1, 2].map((k) => { let v = 100 * (k + 1); return XS.map(() => (v += rnd() - 0.5)); });
"""

# Each snippet draws into <div id="c"> and calls done() once drawn.
CHARTS = {
    "uPlot": """
new uPlot({width: 900, height: 300, hooks: {draw: [done]},
  series: [{}, ...YS.map((_, k) => ({label: "s" + k, stroke: COLORS[k]}))]},
  [XS, ...YS], document.getElementById("c"));
""",
    "Chart.js": """
const cv = document.createElement("canvas"); cv.width = 900; cv.height = 300;
document.getElementById("c").appendChild(cv);
new Chart(cv, {type: "line",
  data: {datasets: YS.map((ys, k) => ({label: "s" + k, borderColor: COLORS[k], borderWidth: 1, pointRadius: 0,
    data: XS.map((x, i) => ({x: x, y: ys[i]})) }))},
  options: {animation: false, responsive: false, parsing: false, normalized: true,
    scales: {x: {type: "linear"}}},
  plugins: [{id: "mark", afterRender: done}]});
""",
    "ECharts": """
const el = document.getElementById("c"); el.style.width = "900px"; el.style.height = "300px";
const ec = echarts.init(el, null, {renderer: "canvas"});
ec.on("rendered", done);
ec.setOption({animation: false, tooltip: {trigger: "axis"}, legend: {},
  xAxis: {type: "time"}, yAxis: {type: "value", scale: true},
  series: YS.map((ys, k) => ({name: "s" + k, type: "line", showSymbol: false, sampling: undefined,
    lineStyle: {width: 1, color: COLORS[k]}, data: XS.map((x, i) => [x * 1000, ys[i]])}))});
done();
""",
}

PAGE = """<!doctype html><html><head><meta charset="utf-8"><style>{css}</style></head><body>
<div id="c"></div>
<script>{data}</script>
<script>window.__pre = performance.now();</script>
<script>{lib}</script>
<script>window.__parse = performance.now();</script>
<script>
let t0; window.__draw = null;
function done() {{ if (window.__draw === null) window.__draw = performance.now(); }}
t0 = performance.now();
{chart}
window.__build0 = t0;
</script></body></html>"""

# Sanity check after timing: the chart's canvases have drawn pixels.
INKED = """
let n = 0;
for (const c of document.querySelectorAll("canvas")) {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
}
return n;
"""


def version(path: Path, src: str) -> str:
    pkg = path.resolve().parent.parent / "package.json"  # npm layout: <pkg>/dist/<file>
    if pkg.exists():
        return str(json.loads(pkg.read_text(encoding="utf-8")).get("version", "?"))
    m = re.search(r"v?(\d+\.\d+\.\d+)", src[:2000]) or re.search(r'version\s*[:=]\s*"(\d+\.\d+\.\d+)"', src)
    return m.group(1) if m else "?"


def chrome() -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):  # fmt: skip
        opts.add_argument(arg)
    return webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=opts)


def load(url: str) -> dict[str, float]:
    driver = chrome()
    try:
        driver.get(url)
        WebDriverWait(driver, 30, poll_frequency=0.05).until(
            lambda d: d.execute_script("return window.__draw !== null && window.__build0 !== undefined")
        )
        t = driver.execute_script(
            "return {draw: window.__draw, parse: window.__parse, pre: window.__pre, build0: window.__build0}"
        )
        inked = driver.execute_script(INKED)
        if inked < 1000:
            raise RuntimeError(f"{url}: chart not drawn ({inked} inked pixels)")
        return {"draw": t["draw"], "parse": t["parse"], "lib": t["parse"] - t["pre"], "build": t["draw"] - t["build0"]}
    finally:
        driver.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chartjs", type=Path, required=True, help="chart.js/dist/chart.umd.js")
    ap.add_argument("--echarts", type=Path, required=True, help="echarts/dist/echarts.min.js")
    ap.add_argument("--uplot", type=Path, default=UI / "uPlot.iife.min.js")
    ap.add_argument("--loads", type=int, default=7, help="page loads per library")
    args = ap.parse_args()

    libs = {"uPlot": args.uplot, "Chart.js": args.chartjs, "ECharts": args.echarts}
    with tempfile.TemporaryDirectory(prefix="chartlibs-") as tmp:
        urls, info = {}, {}
        for name, path in libs.items():
            src = path.read_text(encoding="utf-8")
            raw = path.read_bytes()
            info[name] = (version(path, src), len(raw), len(gzip.compress(raw, compresslevel=6)))
            css = (UI / "uPlot.min.css").read_text(encoding="utf-8") if name == "uPlot" else ""
            page = Path(tmp) / f"{name.replace('.', '')}.html"
            # "</script" cannot occur inside an inline script; escape it if a library contains it.
            lib = src.replace("</script", "<\\/script")
            page.write_text(PAGE.format(css=css, data=DATA_JS, lib=lib, chart=CHARTS[name]), encoding="utf-8")
            urls[name] = page.as_uri()

        names = list(libs)
        times: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.loads):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                times[name].append(load(urls[name]))

    print(f"{args.loads} loads each, fresh headless Chromium per load, interleaved; ms from navigation start\n")
    print(
        "| library | version | size (B) | gzip -6 (B) | draw median | draw min | parse+eval median | parse+eval min "
        "| script only median | script only min | build median | build min |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        ver, size, gz = info[name]
        cols = []
        for key in ("draw", "parse", "lib", "build"):
            xs = [t[key] for t in times[name]]
            cols += [f"{statistics.median(xs):.1f}", f"{min(xs):.1f}"]
        print(f"| {name} | {ver} | {size:,} | {gz:,} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
