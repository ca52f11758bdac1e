"""Rewrite src/'s comments and docstrings to say why, not when: no dates, no issue numbers, no dated results paths.

    python tools/why_not_when.py          # rewrite in place, move the old lines to CHANGELOG.md, list what is left
    python tools/why_not_when.py --check  # only list what tests/test_why_not_when.py would refuse

Re-runnable after a merge: every rule matches text, not line numbers, and a rule whose text is gone does nothing.
What it does, in order, only on lines that hold a date (20YY-MM-DD) or "issue N":
  1. the phrases in PHRASES, rewritten by hand into the rule and its reason;
  2. a dated results page, `benchmarks/results/2026-11-27-h100-big-model[/call1]` or the bare page name, becomes
     `benchmarks/results/*-h100-big-model` (the page without its date: `ls benchmarks/results/*-NAME` finds it);
  3. the line as it was is appended to CHANGELOG.md under "From the code's comments", with its file, so the story
     (dates, calls, issue numbers) is kept there.
It refuses to write a file whose code would change: the rewritten module must parse to the same syntax tree with
only its string constants different (comments are not in the tree at all). What it cannot rewrite is listed, and
the exit status is 1 while anything is left.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardlab"
CHANGELOG = ROOT / "CHANGELOG.md"
SECTION = "## From the code's comments"
FORBIDDEN = re.compile(r"20\d\d-\d\d-\d\d|issue \d+")

# (file under src/shardlab, old text, new text): the dates and issue numbers that are not a results page's name
PHRASES = [
    ("config.py", "the copy into the bucket is per-parameter host work: issue 15; on otherwise)",
     "the copy into the bucket is per-parameter host work; on otherwise)"),
    ("config.py", "(strategies/zero3_one_rank.py: what each does; issue 15).", "(strategies/zero3_one_rank.py: what each does)."),
    ("strategies/zero3_one_rank.py", "is host work the one GPU waits for (issue 15: one-rank zero3 is host-bound):",
     "is host work the one GPU waits for (one-rank zero3 is host-bound):"),
    ("strategies/deepspeed_config.py", "(issue 15: zero3 was 0.41x dp on one GPU)", "(without them zero3 ran at 0.41x dp on one GPU)"),
    ("strategies/deepspeed_config.py", "host work per module and per parameter (issue 15).", "host work per module and per parameter."),
    ("measure/startup.py", "first optimizer step goes (issue 15's start-up bar): named", "first optimizer step goes: named"),
    ("runtime/pin.py", "Why (issue 15, benchmarks/results/2026-11-27-h100-zero3-gc/, branch gc-lead):",
     "Why (benchmarks/results/*-h100-zero3-gc/):"),
    ("planning/host.py", " on 2026-11-25 once the GPT-2 tokenizer", " once the GPT-2 tokenizer"),
    ("planning/host.py", "tiny-gpt2 run (ps, 2026-11-27);", "tiny-gpt2 run (ps);"),
    ("planning/planner.py", "host (2026-11-26), so ao_offload", "host, so ao_offload"),
    ("planning/planner.py", "(speed order: one H100, benchmarks/results/h100-foundation.md and 2026-11-27-h100-big-model; {measured})",
     "(speed order: one H100, benchmarks/RESULTS.md; {measured})"),
    ("specs/ao_offload.py", "(another host, 2026-11-26)", "(another host)"),
    ("measure/compile_stats.py", "H100 runs of 2026-11-26, process", "H100 runs, process"),
    ("planning/memory.py", "peak_snapshot.py, results 2026-11-26-h100-speed/call2)",
     "peak_snapshot.py, benchmarks/results/*-h100-speed/call2)"),
]
DATED_PAGE = re.compile(r"(?:benchmarks/results/)?(?<![\w*-])20\d\d-\d\d-\d\d-([a-z0-9][\w.-]*[\w])")


def rewrite_line(line: str) -> str:
    return DATED_PAGE.sub(lambda m: f"benchmarks/results/*-{m.group(1)}", line)


def _strings_only_differ(old: str, new: str) -> bool:
    def shape(text: str) -> str:
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                node.value = ""
        return ast.dump(tree)

    return shape(old) == shape(new)


def leftovers(paths=None) -> list[str]:
    out = []
    for path in paths or [*sorted(SRC.rglob("*.py")), ROOT / "README.md"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


def main(check: bool) -> int:
    moved: list[str] = []
    if not check:
        for path in sorted(SRC.rglob("*.py")):
            rel = path.relative_to(SRC).as_posix()
            text = path.read_text()
            new = text
            for where, old, repl in PHRASES:
                if where == rel and old in new:
                    new = new.replace(old, repl)
            lines = new.split("\n")
            for i, line in enumerate(lines):
                if FORBIDDEN.search(line):
                    lines[i] = rewrite_line(line)
            new = "\n".join(lines)
            if new == text:
                continue
            if not _strings_only_differ(text, new):
                print(f"refused: {rel}: the rewrite would change code, not only comments and strings", file=sys.stderr)
                continue
            old_lines = text.split("\n")
            new_set = set(new.split("\n"))
            moved += [f"- `src/shardlab/{rel}`: {line.strip().lstrip('#').strip()}" for line in old_lines
                      if FORBIDDEN.search(line) and line not in new_set]
            path.write_text(new)
        if moved:
            log = CHANGELOG.read_text()
            if SECTION not in log:
                log = log.rstrip("\n") + (f"\n\n{SECTION}\n\nThe dates, issue numbers and dated results pages that "
                                          "comments in `src/` cited, as they were before the comments were rewritten "
                                          "to the rule and its reason (`tools/why_not_when.py`).\n")
            have = set(log.splitlines())
            log = log.rstrip("\n") + "\n\n" + "\n".join(m for m in moved if m not in have) + "\n"
            CHANGELOG.write_text(log)
    left = leftovers()
    for item in left:
        print(item)
    print(f"why_not_when: {len(moved)} lines rewritten, {len(left)} left", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
