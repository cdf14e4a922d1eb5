"""The fixture run's HTML report opened in headless Chromium: what a reader sees, not just the markup.

Chromium comes from the system (Debian package ``chromium``, ``make browser``). Without it these tests
fail, never skip: a report nobody looked at in a browser is the thing they exist to catch.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from rulewatch.spark.present.report import PALETTE, build_report

pytestmark = [pytest.mark.jvm, pytest.mark.browser]

WIDTH, HEIGHT = 1280, 2000
# Flags for a machine without a display, sandbox or network (see docs/dashboards.md, "Locally").
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars")  # fmt: skip


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("Chromium is not installed: run `make browser` (installs Debian's chromium package)")
    return found


def _run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"  # a fresh profile per start
    command = [chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB(A) rows of an 8-bit, non-interlaced truecolour PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unexpected PNG format {header}"
    channels = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG filter of this row
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(bytes(line) if channels == 3 else bytes(b for j, b in enumerate(line) if j % 4 != 3))
        previous = line
    return width, height, rows


@pytest.fixture(scope="module")
def report_file(spark, fixture_run, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(build_report(spark, fixture_run.lakehouse), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def screenshot(report_file) -> Path:
    png = report_file.with_name("report.png")
    _run_chromium(report_file.parent, f"--screenshot={png}", f"--window-size={WIDTH},{HEIGHT}", report_file.as_uri())
    # Kept beside the report for a person to look at: pytest prints tmp paths on failure.
    return png


def _colour(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def test_screenshot_shows_the_header_tiles_and_drawn_charts(screenshot):
    width, height, rows = read_png(screenshot)
    assert (width, height) == (WIDTH, HEIGHT)
    pixels = [tuple(row[i : i + 3]) for row in rows[::4] for i in range(0, len(row), 12)]  # every 4th pixel each way
    assert len(set(pixels)) > 200, "a blank or near-blank page"
    assert tuple(rows[20][60:63]) == _colour("#111827"), "the dark header band is missing"
    background = sum(p == _colour("#f3f4f6") for p in pixels) / len(pixels)
    white = sum(p == (255, 255, 255) for p in pixels) / len(pixels)
    assert background > 0.03 and white > 0.3, "cards (white) on the grey page background should fill most of it"
    # Bars and lines in the palette's first colours: the SVG charts were drawn, not left empty.
    for colour in PALETTE[:3]:
        assert sum(p == _colour(colour) for p in pixels) > 20, f"no {colour} marks in the charts"


def test_rendered_dom_has_the_tiles_and_time_axes(report_file, tmp_path):
    dom = _run_chromium(tmp_path, "--dump-dom", report_file.as_uri()).stdout
    for label in ("Alerts", "Keys alerted", "Lines ingested (bronze)", "Quarantined", "Duplicates dropped",
                  "Late events (not evaluated)", "Newest event in silver", "Last gold batch ended"):  # fmt: skip
        assert f'<div class="label">{label}</div>' in dom
    assert "Hour of event time (UTC)" in dom and "2026-11-01 10:00" in dom
    assert re.search(r"Gold batch end(, \d{4}-\d\d-\d\d)? \(UTC\)", dom)
    assert "p50 is the median" in dom
