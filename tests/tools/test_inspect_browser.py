"""The ``--graph html`` page in a real headless browser: it draws the graph, search finds
nodes, and a click on a node opens its details (rule, scheme, qparams).

Needs the ``playwright`` package (the ``dev`` extra) and a system Chromium (Debian:
``apt-get install chromium``; ``.ci/run`` installs it when it can). Playwright's own
browser download is never used. Without either, the test is skipped and says why.
"""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.tools.inspect_picture import graph, html, svg

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(name).exists():
            return name
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Any:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    exe = _chromium()
    if exe is None:
        pytest.skip("no system Chromium (apt-get install chromium); the browser test needs it")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _png_is_not_blank(data: bytes) -> bool:
    """Decode the PNG's pixel rows (no imaging library needed) and look for variety."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    pixels = zlib.decompress(idat)
    return len(set(pixels[::7])) > 20


def test_page_draws_searches_and_shows_details(browser: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
        {"match": {"module": ["Conv2d", "Linear"]},
         "weight": {"dtype": "int8", "symmetric": True, "granularity": "per_channel"},
         "activation": {"dtype": "uint8", "symmetric": False}}]}})
    gm = qc.qcompile(Net().eval(), spec, (torch.randn(1, 3, 8, 8),))
    pg = graph.from_graph_module(gm)
    page_file = tmp_path / "graph.html"
    page_file.write_text(html.to_html(pg, svg.to_svg(pg), title="net"), encoding="utf-8")

    page = browser.new_page(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(page_file.as_uri())
    assert page.locator("#canvas svg g.node").count() == len(pg.nodes)
    shot = page.screenshot(path=str(tmp_path / "graph.png"))
    assert _png_is_not_blank(shot)
    assert all(u.startswith("file://") for u in requests), requests  # offline: no network

    # a click on the conv opens its details: rule, scheme, parameters
    page.locator('g.node[data-id="conv2d"]').click()
    panel = page.locator("#details")
    assert panel.is_visible()
    assert panel.locator("h2").inner_text() == "conv"
    rows = dict(zip(panel.locator("td:first-child").all_inner_texts(),
                    panel.locator("td:last-child").all_inner_texts()))
    assert rows["scheme"].startswith("weight int8 per_channel sym")
    assert rows["rule"] == "#0 module=Conv2d,Linear"
    assert rows["parameters"] == "conv.weight, conv.bias"
    assert rows["weight qparams"].startswith("int8 per_channel, scale ")
    assert rows["output qparams"].startswith("uint8 per_tensor, scale ")
    # a quantizer's qparams
    page.locator('g.node[data-id="fc_output_fake_quant"]').click()
    rows = dict(zip(panel.locator("td:first-child").all_inner_texts(),
                    panel.locator("td:last-child").all_inner_texts()))
    assert rows["dtype"] == "uint8" and "scale" in rows and "zero_point" in rows

    # search highlights the matches and centres the view on the first
    before = page.locator("#canvas svg").get_attribute("viewBox")
    page.fill("#search", "fake_quant")
    hits = page.locator("g.node.hit")
    assert hits.count() == sum(n.kind == "quantizer" for n in pg.nodes) == 4
    assert page.locator("#count").inner_text() == "4 matches"
    assert page.locator("#canvas svg").get_attribute("viewBox") != before
    # zoom and fit change the view box and keep it finite
    page.click("#fit")
    page.mouse.move(500, 400)
    page.mouse.wheel(0, -300)
    box = page.locator("#canvas svg").get_attribute("viewBox") or ""
    assert all(float(v) == float(v) for v in box.split())  # no NaN
    assert errors == []
    page.close()
