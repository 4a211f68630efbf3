"""`report.html` rendered in headless Chromium: every figure loads and no text overflows its box.

Chromium is Debian's `chromium` package (`.ci/run` installs it when missing); where it cannot be
installed the test is skipped with the reason. The page is loaded as a copy with one script
appended that, once the page has loaded, lists every image that did not decode or runs past the
page, and every element whose content is wider than its box (a box that scrolls on purpose,
`overflow` other than visible, is allowed); `--dump-dom` hands the list back.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.bench.report import write_report

RESULTS = Path(__file__).resolve().parent.parent / "results"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")

CHECK_SCRIPT = """
<script>
window.addEventListener("load", () => {
  const problems = [];
  const page = document.documentElement.clientWidth;
  for (const img of document.images) {
    const box = img.getBoundingClientRect();
    if (!img.complete || img.naturalWidth === 0) problems.push("image did not load: " + img.alt);
    else if (box.right > page + 1) problems.push("image runs past the page: " + img.alt);
  }
  for (const el of document.querySelectorAll("body, body *")) {
    if (el.tagName === "IMG" || el.id === "browser-check") continue;
    const style = getComputedStyle(el);
    if (style.overflowX !== "visible" || el.clientWidth === 0) continue;
    if (el.scrollWidth > el.clientWidth + 1)
      problems.push("text overflows <" + el.tagName.toLowerCase() + "> by " + (el.scrollWidth - el.clientWidth)
                    + " px: " + el.textContent.trim().slice(0, 80));
  }
  const out = document.createElement("pre");
  out.id = "browser-check";
  out.textContent = JSON.stringify({images: document.images.length, problems: problems});
  document.body.appendChild(out);
});
</script>
"""


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def render_checks(html_file: Path, width: int) -> dict:
    """Load `html_file` (with the check script appended) at `width` px; returns the script's report."""
    page = html_file.with_name("checked.html")
    page.write_text(html_file.read_text(encoding="utf-8").replace("</body>", CHECK_SCRIPT + "</body>"),
                    encoding="utf-8")
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--window-size={width},1000", "--virtual-time-budget=20000", "--dump-dom", page.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="browser-check">(.*?)</pre>', done.stdout, re.S)
    assert found, f"no check output from {cmd[0]} (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
                      .replace("&amp;", "&"))


@pytest.fixture(scope="module")
def report_html(tmp_path_factory) -> Path:
    if browser() is None:
        pytest.skip("no headless Chromium: install Debian's `chromium` package (.ci/run does) to run this test")
    files = sorted(RESULTS.glob("cpu_*.json"))
    assert files, "no committed bench results to report on"
    out = tmp_path_factory.mktemp("report")
    write_report(files, out)
    return out / "report.html"


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 800])
def test_report_page_loads_every_figure_and_no_text_overflows(report_html, width):
    checks = render_checks(report_html, width)
    assert checks["images"] > 0
    assert checks["problems"] == [], "\n".join(checks["problems"][:20])


@pytest.mark.slow
def test_the_check_finds_a_broken_image_and_an_overflowing_cell(tmp_path):
    """The check itself can fail: a figure that cannot decode and a cell too narrow for its text."""
    if browser() is None:
        pytest.skip("no headless Chromium: install Debian's `chromium` package (.ci/run does) to run this test")
    page = tmp_path / "bad.html"
    page.write_text('<html><body><img alt="broken" src="data:image/png;base64,AAAA">'
                    '<div style="width:40px;white-space:nowrap">a caption far wider than its box</div>'
                    "</body></html>", encoding="utf-8")
    problems = render_checks(page, 800)["problems"]
    assert any(p.startswith("image did not load: broken") for p in problems), problems
    assert any(p.startswith("text overflows <div>") for p in problems), problems
