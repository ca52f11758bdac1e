"""MkDocs hooks (mkdocs.yml `hooks:`): the generated parts of the site, made at every build.

- reference/cli.md, config.md, summary.md, errors.md: from the code (reference.py).
- results/index.md from benchmarks/RESULTS.md, changelog.md from CHANGELOG.md, and results/<page>.md for each dated
  results page they link (their links rewritten to point inside the site; a link to a data file becomes its path).
- figures/: the HTML report and plots of a committed bench, the pipeline simulator's diagrams and the plan of a 7B
  model (figures.py), and the `<!-- generated: NAME -->` markers in pages replaced by the tables made from them (and
  the patches table, from shardlab.compat: reference.patches_table).
The build imports this checkout's src/ (not an installed shardlab), so the site describes the code beside it.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import figures  # noqa: E402 - after the path set-up above
import reference  # noqa: E402

RESULTS_DIR = "benchmarks/results"
# repo file -> site page, for the files the site carries whole
SITE_PAGES = {"benchmarks/RESULTS.md": "results/index.md", "CHANGELOG.md": "changelog.md"}
LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")

_state: dict = {}


def _results_page(repo_path: str) -> str | None:
    """The site page of a results file or folder (its README.md), or None when it is not a page."""
    path = repo_path.rstrip("/")
    if not path.startswith(RESULTS_DIR + "/"):
        return None
    rel = path[len(RESULTS_DIR) + 1:]
    if rel.endswith("/README.md"):
        rel = rel[: -len("/README.md")]
    elif rel.endswith(".md"):
        rel = rel[:-3]
    elif not (ROOT / path / "README.md").is_file():
        return None
    return "results/" + rel.replace("/", "--") + ".md"


def _source_of(site_page: str) -> str:
    for repo, page in SITE_PAGES.items():
        if page == site_page:
            return repo
    rel = site_page[len("results/"):-3].replace("--", "/")
    md = ROOT / RESULTS_DIR / (rel + ".md")
    return f"{RESULTS_DIR}/{rel}.md" if md.is_file() else f"{RESULTS_DIR}/{rel}/README.md"


def rewrite_links(text: str, repo_file: str, site_page: str, queue: list[str]) -> str:
    """Links of a repo Markdown file, made to work from its site page: a page the site carries is linked there (and
    queued to be carried), a docs page keeps its link, anything else becomes its repo path in code."""

    def fix(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path, _, frag = target.partition("#")
        repo = posixpath.normpath(posixpath.join(posixpath.dirname(repo_file), path)) + ("/" if path.endswith("/") else "")
        page = SITE_PAGES.get(repo.rstrip("/")) or _results_page(repo)
        if page is None and repo.startswith("docs/") and repo.endswith(".md"):
            page = repo[len("docs/"):]
        if page is None:
            shown = repo.rstrip("/") + ("/" if path.endswith("/") else "")
            return label if label.strip("`") == shown else f"{label} (`{shown}`)"
        if page not in SITE_PAGES.values() and page.startswith("results/") and page not in queue:
            queue.append(page)
        rel = posixpath.relpath(page, posixpath.dirname(site_page) or ".")
        return f"[{label}]({rel}{'#' + frag if frag else ''})"

    return LINK.sub(fix, text)


def on_config(config):
    """This checkout's src/ first on the path for the whole build (MkDocs restores sys.path after importing a hook,
    so a path set at import would be gone, and an installed shardlab would be described instead)."""
    src = str(ROOT / "src")
    if sys.path[0] != src:
        sys.path.insert(0, src)
    for name in [m for m in sys.modules if m == "shardlab" or m.startswith("shardlab.")]:
        if not str(getattr(sys.modules[name], "__file__", "") or "").startswith(src):
            del sys.modules[name]
    return config


def on_files(files, config):
    for uri, page in reference.PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    queue: list[str] = []
    for repo, page in SITE_PAGES.items():
        text = (ROOT / repo).read_text()
        files.append(File.generated(config, page, content=rewrite_links(text, repo, page, queue)))
    done: set[str] = set()
    while queue:
        page = queue.pop(0)
        if page in done:
            continue
        done.add(page)
        repo = _source_of(page)
        text = rewrite_links((ROOT / repo).read_text(), repo, page, queue)
        files.append(File.generated(config, page, content=text))

    out = Path(tempfile.mkdtemp(prefix="shardlab-docs-"))
    _state["tmp"] = out
    made = figures.generate(out)
    _state["tables"] = figures.plan_tables(json.loads(made["plan-7b"].read_text()))
    bubbles = {p.stem.removeprefix("timeline-"): float(p.read_text()) for p in made["pipeline"].glob("timeline-*.txt")}
    _state["tables"]["patches"] = reference.patches_table()
    _state["tables"]["pipeline-bubbles"] = "\n".join(
        ["| schedule (4 stages, 8 micro-batches, backward = 2 x forward) | bubble |", "|---|---|"]
        + [f"| {name} | {bubbles[name]:.1%} |" for name in ("gpipe", "1f1b", "interleaved-1f1b")])
    for path in sorted(made["report"].rglob("*")):
        if path.is_file() and path.suffix in (".html", ".png"):
            files.append(File.generated(config, "figures/report/" + path.relative_to(made["report"]).as_posix(),
                                        abs_src_path=str(path)))
    for path in sorted(made["pipeline"].glob("*.png")):
        files.append(File.generated(config, "figures/pipeline/" + path.name, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def fill(m: re.Match) -> str:
        name = m.group(1)
        if name not in _state.get("tables", {}):
            raise KeyError(f"{page.file.src_uri}: no generated content named {name!r} (tools/docs/hooks.py)")
        return _state["tables"][name]

    return MARKER.sub(fill, markdown)


def on_post_build(config):
    tmp = _state.pop("tmp", None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
