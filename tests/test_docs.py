"""The docs site: built with warnings as errors, every internal link and anchor resolves, and it renders.

One strict MkDocs build (module fixture: the tests of this module share it, on one xdist worker) into a temporary
directory; the build generates the references, the results pages and the figures from this checkout
(tools/docs/hooks.py). `make docs` runs the same build into site/.
"""

from __future__ import annotations

import html.parser
import os
import posixpath
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_site(out: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    return res, time.monotonic() - start


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("material", reason="mkdocs-material is a test extra: pip install -e '.[test]' (make setup-test)")
    out = tmp_path_factory.mktemp("site")
    res, seconds = build_site(out)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    print(f"docs: mkdocs build --strict took {seconds:.1f} s")
    return out


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and not (tag == "link" and key == "href" and a.get("rel") in ("canonical",)):
                self.links.append(a[key])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(errors="replace"))
    return parser


def test_site_builds_strict_and_every_internal_link_and_anchor_resolves(site):
    # 404.html is served at any missing path, so MkDocs gives it root-absolute links: it is not checked here
    pages = {p: _parse(p) for p in site.rglob("*.html") if p.name != "404.html"}
    assert len(pages) >= 25
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link} (no such file)")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {link} (no anchor)")
    assert not broken, "\n".join(broken[:40])


def test_a_newcomer_finds_the_answers_in_one_hop_from_home(site):
    """The home page links straight to: how to start, a 7B on one 80 GB GPU, 2 nodes under SLURM, what
    gpu_mem_peak_gib means, the five most common errors; each target says it."""
    home = _parse(site / "index.html")
    wanted = {"getting-started.html": "make demo", "how-to/model-too-big.html#a-7b-model-on-one-80-gb-gpu": "ao_offload",
              "how-to/slurm.html#two-nodes-under-slurm": "--nodes 2",
              "reference/summary.html#gpu_mem_peak_gib": "max_memory_allocated",
              "reference/errors.html#most-common": "The five most common"}
    for link, text in wanted.items():
        assert link in home.links, link
        assert text in (site / link.split("#")[0]).read_text(), (link, text)
    errors = (site / "reference/errors.html").read_text()
    common = errors.split('id="most-common"')[1].split('id="every-error"')[0]
    assert common.count("cause:") == 5 and common.count("fix:") == 5


def test_generated_pictures_and_tables_are_in_the_site(site):
    for name in ("timeline-1f1b.png", "timeline-gpipe.png", "tutorial_1_naive.png"):
        assert (site / "figures/pipeline" / name).stat().st_size > 1000
    assert (site / "figures/report/report.html").stat().st_size > 10_000
    assert len(list((site / "figures/report/plots").glob("*.png"))) >= 4
    pipeline = (site / "concepts/pipeline.html").read_text()
    assert "<!-- generated" not in pipeline and "interleaved-1f1b" in pipeline
    strategies = (site / "concepts/strategies.html").read_text()
    assert "<!-- generated" not in strategies and "ao_offload" in strategies and "bytes/param" in strategies
    results = (site / "results/index.html").read_text()
    assert 'href="2026-11-25-cpu-demo.html"' in results  # a dated page, carried into the site


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(not _chromium(), reason="headless Chromium is not installed (make setup-test installs Debian's "
                                              "`chromium` when root)")
def test_site_renders_in_headless_chromium(site, tmp_path):
    import matplotlib.image

    for page in ("index.html", "reference/cli.html"):
        shot = tmp_path / (page.replace("/", "-") + ".png")
        res = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              "--hide-scrollbars", "--window-size=1280,1600", f"--screenshot={shot}",
                              (site / page).as_uri()], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
        pixels = matplotlib.image.imread(str(shot))[..., :3]
        assert pixels.shape[:2] == (1600, 1280)
        non_white = (pixels.mean(axis=2) < 0.95).mean()
        assert non_white > 0.03 and pixels.std() > 0.05, (page, non_white, pixels.std())  # text and tables drawn


def test_rewritten_links_point_into_the_site_or_name_the_file():
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    import hooks

    queue: list[str] = []
    text = ("[page](results/2026-11-25-cpu-demo/) [data](results/2026-11-25-cpu-demo/summary.json) "
            "[log](../CHANGELOG.md#docs) [web](https://example.org)")
    out = hooks.rewrite_links(text, "benchmarks/RESULTS.md", "results/index.md", queue)
    assert "[page](2026-11-25-cpu-demo.md)" in out and queue == ["results/2026-11-25-cpu-demo.md"]
    assert "data (`benchmarks/results/2026-11-25-cpu-demo/summary.json`)" in out
    assert "[log](../changelog.md#docs)" in out and "[web](https://example.org)" in out
    assert posixpath.basename(queue[0]) == "2026-11-25-cpu-demo.md"
