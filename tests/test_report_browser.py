"""report.html as a person sees it: stage 01 run through `draftsmith run`, its report opened in a
real headless Chromium (Debian's package; `.ci/run` installs it). In the rendered page every figure
has loaded, no warning text shows, no table cell is cut short with "…", no word is broken across
lines, nothing is wider than the window (wide tables scroll in their own box), and no folder of this
machine is named."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
# Runs in the page once it has loaded; the verdict is written into the DOM that --dump-dom prints.
PROBE = """<script>
const W = () => document.documentElement.clientWidth;
const scrollsInside = e => {
  for (let a = e.parentElement; a; a = a.parentElement)
    if (["auto", "scroll"].includes(getComputedStyle(a).overflowX)) return a.getBoundingClientRect().right <= W() + 1;
  return false;
};
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const cells = [...document.querySelectorAll("td, th")].map(c => c.innerText.trim());
  const verdict = {
    images: imgs.length,
    broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 40)),
    cells: cells.length,
    truncated: cells.filter(t => t.endsWith("…") || t.endsWith("...")),
    warnings: document.body.innerText.split("\\n").filter(l => /Warning\\b/.test(l)),
    page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
    // wider than the window and not inside a box that scrolls sideways: cut off for the reader
    wide: [...document.body.querySelectorAll("*")].filter(e => e.getBoundingClientRect().right > W() + 1
      && !scrollsInside(e)).map(e => e.tagName + " " + (e.innerText || "").slice(0, 60)).slice(0, 10),
    // every table and code block ends inside the page; what does not fit scrolls in that box itself
    boxes: [...document.querySelectorAll("table, pre")].filter(e => e.getBoundingClientRect().right > W() + 1)
      .map(e => e.tagName + " " + (e.innerText || "").slice(0, 60)),
    // a word broken across lines: a table cell or printed text allowed to break inside words
    midword: [...document.querySelectorAll("td, pre")].filter(e => getComputedStyle(e).overflowWrap === "anywhere"
      || getComputedStyle(e).wordBreak === "break-all").map(e => e.tagName + " " + (e.innerText || "").slice(0, 40)).slice(0, 5),
    scrolling: [...document.querySelectorAll("*")].filter(e => e.scrollWidth > e.clientWidth + 1
      && ["auto", "scroll"].includes(getComputedStyle(e).overflowX)).length,
  };
  const out = document.createElement("pre");
  out.id = "verdict";
  out.textContent = JSON.stringify(verdict);
  document.body.appendChild(out);
});
</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: apt-get install -y chromium chromium-driver (.ci/run does)"
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    r = subprocess.run([str(Path(sys.executable).with_name("draftsmith")), "run", "01", "-f",
                        str(REPO / "params/smoke.yaml"), "-p", "outputs_dir", str(out), "-p", "probe_prompts", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "smoke" / "report.html"


def test_report_renders_in_chromium_with_every_figure_no_warning_and_whole_columns(report, tmp_path):
    page = tmp_path / "page.html"
    page.write_text(report.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    browser = [chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--window-size=800,2000", "--virtual-time-budget=5000", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    verdict = json.loads(re.search(r'<pre id="verdict">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    assert verdict["images"] >= 2 and verdict["broken"] == [], verdict
    assert verdict["cells"] > 20 and verdict["truncated"] == [], verdict
    assert verdict["warnings"] == [], verdict
    assert verdict["wide"] == [] and verdict["boxes"] == [] and verdict["page"][0] <= verdict["page"][1], verdict
    assert verdict["midword"] == [], verdict   # no word is broken: a cell wraps between words, a wide one scrolls
    assert verdict["scrolling"] >= 1, verdict  # the endpoint tables are wider than 800 px: they scroll in their box
    shot = tmp_path / "report.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1200,2400", report.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_report_names_no_folder_of_this_machine(report):
    """Shared as is: the run folder, the repository and the home folder appear in relative or `~`
    form only (embedded figures aside, whose base64 may spell anything)."""
    html = re.sub(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=\s]+", "", report.read_text(encoding="utf-8"))
    for folder in (report.parents[1], REPO, Path.home()):
        assert str(folder) + "/" not in html and f"{folder}<" not in html and f"{folder}`" not in html, folder
    assert "notebooks themselves are in <code>notebooks</code>" in html
