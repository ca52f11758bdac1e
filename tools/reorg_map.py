#!/usr/bin/env python3
"""Rewrite imports and dotted names of shardlab's old flat modules to their packages (issue 13, item 3).

    python tools/reorg_map.py PATH...        rewrite in place (files, or directories walked for .py/.sh/.md/.toml/.yaml/Makefile)
    python tools/reorg_map.py --check PATH...  print what would change, change nothing (exit 1 if anything would)

The mapping is tools/reorg_map.txt (old_module -> new_module). What is rewritten:
  * `from shardlab.OLD import x`, `from shardlab import OLD`, `import shardlab.OLD [as y]`;
  * relative imports (`from .OLD import x`, `from . import OLD`, `from ..OLD import x`) in a file at its old place
    or already moved to its new one: they are resolved against the file's current module first, and only when
    that names nothing in the new tree, against the module's old name (reorg_map.txt read backwards);
    the result stays relative (absolute stays absolute); `from . import checkpoint` becomes
    `from . import store as checkpoint`, so the code below the imports is unchanged;
  * any other dotted text `shardlab.OLD[.attr]` (mock.patch / monkeypatch strings, `python -m shardlab.worker`,
    sys.modules keys, prose) and paths `shardlab/OLD.py`.
Idempotent: a name that already exists in the new tree (a module, or a name a package's __init__ defines) is
left alone, so running it twice, or on a half-converted file, changes nothing more. A bare `shardlab.launch` or
`shardlab.checkpoint` in prose is ambiguous (old module, or new package) and is left alone with a warning.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
MAP_FILE = HERE / "reorg_map.txt"
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".json"}
TEXT_NAMES = {"Makefile"}


def load_map(path: Path = MAP_FILE) -> tuple[dict[str, str], set[str]]:
    """(old -> new for the modules that were renamed, the modules that kept their name but became a package)."""
    mapping, as_package = {}, set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            old, new = (s.strip() for s in line.split("->"))
            if old != new:
                mapping[old] = new
            else:
                as_package.add(old)  # e.g. cli.py -> cli/__init__.py: same name, relative imports one level deeper
    return mapping, as_package


MAPPING, AS_PACKAGE = load_map()
REVERSE = {v: k for k, v in MAPPING.items()}


def _tree_modules() -> dict[str, Path]:
    """Modules of the new tree (on disk under src/, plus every mapping target): name -> file (or None)."""
    mods: dict[str, Path | None] = {}
    for p in (SRC / "shardlab").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    for new in MAPPING.values():
        mods.setdefault(new, None)
        parts = new.split(".")
        for i in range(1, len(parts)):
            mods.setdefault(".".join(parts[:i]), None)
    return mods


MODULES = _tree_modules()
_defined_cache: dict[str, set[str]] = {}


def defines(module: str, name: str) -> bool:
    """Whether `from module import name` is valid in the new tree (a submodule, or a top-level name)."""
    if f"{module}.{name}" in MODULES:
        return True
    path = MODULES.get(module)
    if path is None:
        return False
    if module not in _defined_cache:
        names: set[str] = set()
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, OSError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                        names.add(sub.name)
                    elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                        names.update((a.asname or a.name).split(".")[0] for a in sub.names)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.id)
        _defined_cache[module] = names
    return name in _defined_cache[module] or (not path.name == "__init__.py" and False)


def is_module_in_new_tree(module: str) -> bool:
    return module in MODULES


def new_name(old: str) -> str | None:
    """The new name of an old module (or of a dotted name inside one), None when it did not move."""
    parts = old.split(".")
    for i in range(len(parts), 1, -1):
        head = ".".join(parts[:i])
        if head in MAPPING:
            return ".".join([MAPPING[head]] + parts[i:])
    return None


def module_of(path: Path) -> tuple[str | None, bool]:
    """The dotted module name of a file under a `shardlab` package directory, and whether it is a package."""
    path = path.resolve()
    parts = list(path.with_suffix("").parts)
    if "shardlab" not in parts or path.suffix != ".py":
        return None, False
    i = len(parts) - 1 - parts[::-1].index("shardlab")
    mod = parts[i:]
    ispkg = mod[-1] == "__init__"
    if ispkg:
        mod = mod[:-1]
    return ".".join(mod), ispkg


def resolve(current: str, ispkg: bool, level: int, module: str | None) -> str:
    base = current.split(".")
    if not ispkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def relative(current: str, ispkg: bool, target: str) -> tuple[int, str]:
    """(level, module) for `from <level dots><module> import ...` naming `target` from `current`."""
    pkg = current.split(".") if ispkg else current.split(".")[:-1]
    tgt = target.split(".")
    common = 0
    while common < min(len(pkg), len(tgt)) and pkg[common] == tgt[common]:
        common += 1
    return len(pkg) - common + 1, ".".join(tgt[common:])


def _valid_new(base: str, names: list[ast.alias]) -> bool:
    if base not in MODULES:
        return False
    return all(a.name == "*" or defines(base, a.name) or (MODULES.get(base) and not str(MODULES[base]).endswith("__init__.py"))
               for a in names)


def rewrite_importfrom(node: ast.ImportFrom, current: str | None, ispkg: bool) -> list[tuple[str, list[tuple[str, str | None]]]] | None:
    """New (absolute module, [(name, asname)]) groups for one `from ... import ...`, or None when unchanged."""
    if node.level:
        if current is None:
            return None
        base = resolve(current, ispkg, node.level, node.module)
        moved = current in REVERSE or (current in AS_PACKAGE and ispkg)
        if moved and not _valid_new(base, node.names):
            # written for the module's old place: resolve it there
            base = resolve(REVERSE.get(current, current), False, node.level, node.module)
    else:
        base = node.module or ""
        if not base.startswith("shardlab"):
            return None
    groups: dict[str, list[tuple[str, str | None]]] = {}
    changed = False
    for a in node.names:
        full = f"{base}.{a.name}"
        if full in MAPPING and not (full in MODULES and f"{base}.{a.name}" not in MAPPING):
            target = MAPPING[full]
            parent, leaf = target.rsplit(".", 1)
            groups.setdefault(parent, []).append((leaf, a.asname or (a.name if leaf != a.name else None)))
            changed = True
        elif base in MAPPING and not defines(base, a.name):
            groups.setdefault(MAPPING[base], []).append((a.name, a.asname))
            changed = True
        else:
            groups.setdefault(base, []).append((a.name, a.asname))
    if node.level and current is not None and resolve(current, ispkg, node.level, node.module) != base:
        changed = True
    return list(groups.items()) if changed else None


def format_from(groups, node: ast.ImportFrom, current: str | None, ispkg: bool, indent: str) -> str:
    lines = []
    for module, names in groups:
        if node.level and current is not None:
            level, rest = relative(current, ispkg, module)
            head = "." * level + rest
        else:
            head = module
        body = ", ".join(n if not a or a == n else f"{n} as {a}" for n, a in names)
        lines.append(f"from {head} import {body}")
    return ("\n" + indent).join(lines)


DOTTED = re.compile(r"(?<![\w.])shardlab(?:\.[A-Za-z_]\w*)+")
PATHLIKE = re.compile(r"(?<![\w])shardlab/([a-z_]+)\.py\b")


def rewrite_dotted(text: str, warn: list[str]) -> str:
    def sub(m: re.Match) -> str:
        dotted = m.group(0)
        parts = dotted.split(".")
        for i in range(len(parts), 1, -1):
            head = ".".join(parts[:i])
            if head in MAPPING:
                if head in MODULES:  # also a package of the new tree (shardlab.launch, shardlab.checkpoint)
                    if i == len(parts):
                        warn.append(dotted)
                        return dotted
                    nxt = f"{head}.{parts[i]}"
                    if nxt in MODULES or defines(head, parts[i]):
                        return dotted
                return ".".join([MAPPING[head]] + parts[i:])
            if head in MODULES and i > 1:
                return dotted  # already a new-tree module (or an attribute of one)
        return dotted

    def subpath(m: re.Match) -> str:
        old = f"shardlab.{m.group(1)}"
        if old in MAPPING:
            return MAPPING[old].replace(".", "/") + ".py"
        return m.group(0)

    return PATHLIKE.sub(subpath, DOTTED.sub(sub, text))


def rewrite_python(text: str, path: Path, warn: list[str]) -> str:
    tree = ast.parse(text)
    current, ispkg = module_of(path)
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    edits = []  # (start, end, replacement)
    import_spans = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        import_spans.append((start, end))
        indent = " " * node.col_offset
        if isinstance(node, ast.ImportFrom):
            groups = rewrite_importfrom(node, current, ispkg)
            if groups is not None:
                new = format_from(groups, node, current, ispkg, indent)
                original = [(a.name, a.asname) for a in node.names]
                if len(groups) == 1 and groups[0][1] == original:  # only the module changed: keep the statement's layout
                    head = new.split(" import ", 1)[0]
                    new = re.sub(r"^from\s+\S+", lambda m: head, text[start:end], count=1)
                edits.append((start, end, new))
        else:
            new_names, changed = [], False
            for a in node.names:
                n = new_name(a.name) if a.name not in MODULES or a.name in MAPPING else None
                if n and a.name in MODULES and a.name in MAPPING and a.name.count(".") == 1 and a.asname is None:
                    warn.append(f"{path}:{node.lineno}: `import {a.name}` (package or old module?)")
                    n = None
                if n:
                    changed = True
                    new_names.append(f"{n} as {a.asname}" if a.asname else n)
                else:
                    new_names.append(f"{a.name} as {a.asname}" if a.asname else a.name)
            if changed:
                edits.append((start, end, "import " + ", ".join(new_names)))
    # dotted names outside import statements
    out, pos = [], 0
    import_spans.sort()
    for start, end in import_spans:
        out.append(rewrite_dotted(text[pos:start], warn))
        out.append(text[start:end])
        pos = end
    out.append(rewrite_dotted(text[pos:], warn))
    text2 = "".join(out)
    assert len(text2) == len(text) or True
    # apply the import edits on the original offsets: rebuild from pieces
    pieces, pos = [], 0
    edit_map = {s: (e, r) for s, e, r in edits}
    for start, end in import_spans:
        pieces.append(rewrite_dotted(text[pos:start], warn))
        if start in edit_map:
            pieces.append(edit_map[start][1])
        else:
            pieces.append(text[start:end])
        pos = end
    pieces.append(rewrite_dotted(text[pos:], warn))
    return "".join(pieces)


def rewrite_file(path: Path, warn: list[str]) -> tuple[str, str]:
    text = path.read_text()
    if path.suffix == ".py":
        try:
            return text, rewrite_python(text, path, warn)
        except SyntaxError:
            pass
    return text, rewrite_dotted(text, warn)


def iter_files(paths):
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.name in TEXT_NAMES) and ".git" not in f.parts:
                    yield f
        elif p.is_file():
            yield p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--check", action="store_true", help="report the files that would change; change nothing")
    args = ap.parse_args(argv)
    changed = 0
    for f in iter_files(args.paths):
        if f.resolve() in (Path(__file__).resolve(), MAP_FILE.resolve()):
            continue
        warn: list[str] = []
        try:
            old, new = rewrite_file(f, warn)
        except UnicodeDecodeError:
            continue
        for w in sorted(set(warn)):
            print(f"warning: {f}: ambiguous, left alone: {w}", file=sys.stderr)
        if new != old:
            changed += 1
            print(("would rewrite " if args.check else "rewrote ") + str(f))
            if not args.check:
                f.write_text(new)
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
