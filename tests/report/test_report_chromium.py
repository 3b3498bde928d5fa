"""report.html in a real browser: headless Chromium, network black-holed, screenshot + rendered DOM.

Chromium comes from Debian (`scripts/install_report_deps.sh`). Missing, the test fails under CI=true
(the install step broke) and skips with the reason on a developer's machine.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import pytest

from fxport.report import write_report
from tests.report.conftest import FIXTURE, ReportIndex, require_tool

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 1400, 3000
# Black-hole the network: every request goes to a proxy on the discard port, every name fails to
# resolve. The page's own CSP forbids fetches too; the console log shows if the page tried any.
OFFLINE_FLAGS = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


def _chromium() -> str:
    return shutil.which("chromium-browser") or require_tool("chromium")


def _run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", *OFFLINE_FLAGS, *args]
    return subprocess.run(cmd, capture_output=True, timeout=120, check=False)


def _page_console(stderr: bytes) -> list[str]:
    """The page's console messages (CSP violations land here) from Chromium's stderr log."""
    return [line for line in stderr.decode(errors="replace").splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    binary = _chromium()
    require_tool("dot")  # the DOM test looks for the drawn graph
    tmp = tmp_path_factory.mktemp("report_chromium")
    report = write_report(FIXTURE, tmp / "report.html")
    url = report.resolve().as_uri()
    dom = _run_chromium(binary, tmp / "profile-dom", "--dump-dom", url)
    png = tmp / "report.png"
    shot = _run_chromium(binary, tmp / "profile-shot", f"--screenshot={png}", f"--window-size={WIDTH},{HEIGHT}", url)
    keep = os.environ.get("FXPORT_REPORT_SCREENSHOT")  # e.g. to look at it: FXPORT_REPORT_SCREENSHOT=/tmp/r.png
    if keep and png.exists():
        shutil.copyfile(png, keep)
    return {"binary": binary, "tmp": tmp, "dom": dom, "shot": shot, "png": png}


def test_rendered_dom_has_tables_charts_and_graph(rendered: dict[str, Any]) -> None:
    dom = rendered["dom"]
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    idx = ReportIndex(dom.stdout.decode())
    for table in ("parity-table", "artifacts-table", "passes-table", "capture-table", "quantization-table"):
        assert idx.body_rows.get(table, 0) > 0, f"{table} has no rows in the rendered DOM"
    assert idx.svg_in.get("profile") == 1 and "profile-chart" in idx.ids
    assert idx.svg_in.get("quantization") == 1 and "sqnr-chart" in idx.ids
    assert idx.svg_in.get("graph") == 2 and "graph-after-graph0" in idx.ids


def test_page_loads_offline_and_asks_for_nothing(rendered: dict[str, Any]) -> None:
    dom = rendered["dom"]
    assert dom.stdout.rstrip().endswith(b"</html>")  # the whole document arrived without a network
    console = _page_console(dom.stderr) + _page_console(rendered["shot"].stderr)
    assert not [c for c in console if "Content Security Policy" in c or "ERR_" in c], console


def test_the_console_probe_would_see_a_page_that_fetches(rendered: dict[str, Any]) -> None:
    """Control for the test above: a page with a remote image and a script does show up in the log."""
    bad = rendered["tmp"] / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                   "content=\"default-src 'none'\"></head><body><img src=\"https://example.invalid/x.png\">"
                   "</body></html>")
    res = _run_chromium(rendered["binary"], rendered["tmp"] / "profile-bad", "--dump-dom", bad.resolve().as_uri())
    assert [c for c in _page_console(res.stderr) if "Content Security Policy" in c]


def test_screenshot_shows_a_rendered_page(rendered: dict[str, Any]) -> None:
    shot, png = rendered["shot"], rendered["png"]
    assert shot.returncode == 0 and png.exists(), shot.stderr.decode(errors="replace")[-2000:]
    width, height, colours = _png_colours(png.read_bytes())
    assert (width, height) == (WIDTH, HEIGHT)
    # A blank or error page has a handful of colours; header, badges, charts and text give hundreds.
    assert colours >= 50, f"only {colours} distinct colours: the page looks blank"


def _png_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct colours) of a PNG; Pillow when installed, else a zlib decoder."""
    try:
        from PIL import Image
    except ImportError:
        return _png_colours_zlib(data)
    import io

    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
        return rgb.width, rgb.height, len(rgb.getcolors(maxcolors=1 << 24) or [])


def _png_colours_zlib(data: bytes) -> tuple[int, int, int]:
    # 8-bit RGB/RGBA non-interlaced, which is what Chromium writes. Slow in pure Python, so it
    # counts colours over every 8th row after undoing the filters of all rows (each needs the previous).
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = bpp = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, "unsupported PNG layout"
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 0xFF
            elif ftype == 4:
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        if y % 8 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return width, height, len(colours)
