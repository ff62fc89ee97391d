"""The built documentation site reads at 1280 px wide, in a real headless Chromium: no page
is wider than the window, code blocks wrap (or fit) instead of scrolling sideways, every
table fits the content column or scrolls inside its own frame, and the troubleshooting
tables (long messages in their first column) fit without scrolling.

The site is built once with ``mkdocs build`` into a temporary folder (about 8 s), or taken
from ``QCOMPILE_DOCS_SITE`` (``.ci/run`` points it at the ``site/`` that ``tools/docs``
built). Needs the ``docs`` extra (mkdocs), the ``playwright`` package (the ``dev`` extra)
and a system Chromium (Debian: ``apt-get install chromium``); without any of them the test
is skipped and says why. Playwright's own browser download is never used. One browser
launch serves every page.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1280, 800
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

# Per page: the document's width, and every code block / table that breaks the layout.
# The content column is Material's .md-content (the article and the frames its tables
# scroll in, which reach a little past the article's padding).
MEASURE = """() => {
  const column = document.querySelector('.md-content').getBoundingClientRect();
  const inside = r => r.left >= column.left - 1 && r.right <= column.right + 1;
  const scrollsInFrame = el => {
    for (let box = el; box && !box.classList.contains('md-content'); box = box.parentElement) {
      const x = getComputedStyle(box).overflowX;
      if ((x === 'auto' || x === 'scroll') && inside(box.getBoundingClientRect())) return true;
    }
    return false;
  };
  const what = el => el.tagName.toLowerCase() + ': ' + el.innerText.slice(0, 70);
  const problems = [];
  for (const el of document.querySelectorAll('article pre, article table')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && !inside(r) && !scrollsInFrame(el))
      problems.push('outside the content column, not in a scrolling frame: ' + what(el));
  }
  for (const code of document.querySelectorAll('article pre > code')) {
    if (code.scrollWidth > code.clientWidth + 1)
      problems.push(`code block scrolls sideways (${code.scrollWidth} > ${code.clientWidth} px): `
                    + what(code));
  }
  return {width: document.scrollingElement.scrollWidth, window: innerWidth, problems};
}"""

# The troubleshooting tables: each fits its frame (nothing to scroll).
FRAMES = """() => [...document.querySelectorAll('article table')].map(t => {
  const frame = t.closest('.md-typeset__scrollwrap') || t.parentElement;
  return {scroll: frame.scrollWidth, frame: frame.clientWidth,
          first: t.querySelector('td').getBoundingClientRect().width,
          table: t.getBoundingClientRect().width};
})"""


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(name).exists():
            return name
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("QCOMPILE_DOCS_SITE")
    if given:
        path = Path(given).resolve()
        assert (path / "index.html").exists(), f"QCOMPILE_DOCS_SITE={given}: no index.html"
        return path
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec(
            "material") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'); tools/docs installs it")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def page(site: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    exe = _chromium()
    if exe is None:
        pytest.skip("no system Chromium (apt-get install chromium); the layout test needs it")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        browser.close()


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_every_page_reads_at_1280_px(site: Path, page: Any) -> None:
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 30, pages  # the whole site, not a stray folder
    found = []
    for html in pages:
        page.goto(html.as_uri())
        got = page.evaluate(MEASURE)
        assert got["window"] == WIDTH
        rel = html.relative_to(site)
        if got["width"] > got["window"]:
            found.append(f"{rel}: the page is {got['width']} px wide")
        found += [f"{rel}: {p}" for p in got["problems"]]
    assert not found, "\n".join(found)


def test_troubleshooting_tables_fit(site: Path, page: Any) -> None:
    page.goto((site / "troubleshooting.html").as_uri())
    frames = page.evaluate(FRAMES)
    assert len(frames) >= 5
    for i, f in enumerate(frames):
        assert f["scroll"] <= f["frame"] + 1, f"table {i} scrolls: {f}"
        # the messages' column keeps a readable share of the width
        assert f["first"] >= 0.3 * f["table"], f"table {i}: first column squeezed: {f}"
    # the picture agrees: the whole page, drawn, is exactly as wide as the window
    width, height = _png_size(page.screenshot(full_page=True))
    assert width == WIDTH and height > HEIGHT
