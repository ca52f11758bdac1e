"""The four generated references of the docs: commands, config keys, summary.json fields and user errors.

Each is read from the code at build time, never written by hand, so it cannot go stale:
  cli_entries      walks `shardlab`'s argparse parser (shardlab.cli.build_parser): every command, flag and default
  config_entries   walks RunConfig's pydantic fields (shardlab.config): every key with type, default and flag
  summary_entries  walks the RunSummary dataclasses (shardlab.measure.summary) and their one-line meanings
                   (shardlab.measure.summary_fields)
  error_entries    reads every `UserError(...)` (and subclass) call in src/ with Python's ast: the message is the
                   cause, the hint the fix
Each *_page function renders one Markdown page; tools/docs/hooks.py adds them to the site and
tests/test_docs_reference.py checks that nothing is missing. patches_table renders shardlab.compat.PATCHES for the
concepts page on patches. Importing this module loads no torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import re
import typing
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _cell(text: object) -> str:
    """Text for one Markdown table cell: no newlines, escaped pipes and angle brackets."""
    out = str(text).replace("\n", " ").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return out.replace("*", "\\*")


def slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


# --------------------------------------------------------------------------------------------------
# commands and flags


@dataclass
class Flag:
    command: str  # "train", "pipeline simulate", ...
    flags: list[str]  # option strings, or the positional's name
    value: str  # what the flag takes ("" for a switch)
    default: str
    help: str
    run_flag: bool  # one of the `train` run flags that plan and slurm share (config keys)

    @property
    def anchor(self) -> str:
        return slug(self.command, self.flags[0].lstrip("-"))


def _config_default(dest: str) -> str | None:
    """The config default behind a run flag's dest (``dataset__source`` -> DatasetConfig.source's), or None."""
    from shardlab.config import RunConfig  # noqa: PLC0415 - the generator's one shardlab import per reference

    model, *parts = RunConfig, *dest.split("__")
    for part in parts[:-1]:
        field = model.model_fields.get(part)
        model = field.default_factory if field is not None and field.default_factory else None
        if model is None:
            return None
    field = model.model_fields.get(parts[-1])
    if field is None:
        return None
    return _show(field.default_factory() if field.default_factory is not None else field.default)


def _show(value: object) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if value == []:
        return "none"
    return str(value)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action, argparse.BooleanOptionalAction):
        return ""
    if action.metavar:
        return str(action.metavar)
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its tree here and nowhere public
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from _walk(sub, path + [name])


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command that runs something ("train", "pipeline simulate", ...) and its parser."""
    from shardlab.cli import build_parser

    out = {}
    for path, parser in _walk(build_parser(), []):
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):  # noqa: SLF001
            out[" ".join(path)] = parser
    return out


def command_help() -> dict[str, str]:
    """Each command's one-line help, as `shardlab --help` shows it."""
    from shardlab.cli import build_parser

    out: dict[str, str] = {}

    def visit(parser, path):
        for action in parser._actions:  # noqa: SLF001
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                helps = {a.dest: a.help for a in action._choices_actions}  # noqa: SLF001
                for name, sub in action.choices.items():
                    out[" ".join(path + [name])] = helps.get(name) or ""
                    visit(sub, path + [name])

    visit(build_parser(), [])
    return out


def cli_entries() -> list[Flag]:
    from shardlab.cli import FLAGS

    run_dests = {key.replace(".", "__") for _, key, _, _ in FLAGS} | {"config", "set"}
    out = []
    for command, parser in command_parsers().items():
        for action in parser._actions:  # noqa: SLF001
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:  # noqa: SLF001
                continue
            flags = list(action.option_strings) or [action.dest]
            if isinstance(action, argparse.BooleanOptionalAction):
                flags = [f for f in flags if not f.startswith("--no-")] + [f for f in flags if f.startswith("--no-")]
            run_flag = bool(action.option_strings) and action.dest in run_dests and command in ("train", "plan", "slurm")
            default = _config_default(action.dest) if run_flag and action.default is None else None
            if default is None:
                if not action.option_strings:
                    default = "required" if action.nargs not in ("?", "*") else "none"
                elif action.nargs == 0 and action.default in (False, None):
                    default = "off"
                else:
                    default = _show(action.default)
            text = (action.help or "").replace("%%", "%")
            stated = re.search(r"\(default:? ([^;)]+)", text)
            if default == "not set" and stated:  # None means "decided later"; the help says what it becomes
                default = stated.group(1).strip()
            if "%(default)" in text:
                text = text.replace("%(default)s", str(action.default))
            out.append(Flag(command, flags, _value(action), default, text, run_flag))
    return out


def cli_page() -> str:
    entries = cli_entries()
    helps = command_help()
    commands = list(dict.fromkeys(e.command for e in entries))
    lines = ["# Command line", "",
             "Generated from `shardlab`'s own argument parser (`shardlab.cli.build_parser`) each time the docs are "
             "built. `shardlab COMMAND --help` prints the same flags.", "",
             "| command | what it does |", "|---|---|"]
    for c in commands:
        lines.append(f"| [`shardlab {c}`](#{slug('shardlab', c)}) | {_cell(helps.get(c, ''))} |")
    lines += ["", "Every `train` flag sets one [config key](config.md) and overrides the YAML given with `--config`; "
              "`plan` and `slurm` take the same [run flags](#run-flags).", ""]
    run = [e for e in entries if e.command == "train" and e.run_flag]
    for c in commands:
        own = [e for e in entries if e.command == c and not e.run_flag]
        lines += [f'## shardlab {c} {{#{slug("shardlab", c)}}}', "", _cell(helps.get(c, "")), ""]
        parser_usage = command_parsers()[c].format_usage().strip().removeprefix("usage: ")
        if len(parser_usage) < 400:
            lines += ["```", parser_usage, "```", ""]
        if any(e.command == c and e.run_flag for e in entries):
            lines += ["Also every one of the [run flags](#run-flags) below.", ""]
        if own:
            lines += _flag_table(own)
        if c == "train":
            lines += ["### Run flags {#run-flags}", "",
                      "`train`, `plan` and `slurm` take these; each sets the [config key](config.md) of the same name. "
                      "A switch `--x` has its `--no-x`.", ""]
            lines += _flag_table(run)
    return "\n".join(lines) + "\n"


def _flag_table(entries: list[Flag]) -> list[str]:
    rows = ["| flag | value | default | what it does |", "|---|---|---|---|"]
    for e in entries:
        names = ", ".join(f"`{f}`" for f in e.flags)
        rows.append(f'| <a id="{e.anchor}"></a>{names} | {_cell(e.value) if e.value else ""} | {_cell(e.default)} | '
                    f"{_cell(e.help)} |")
    return rows + [""]


def key_anchor(key: str) -> str:
    """The page anchor of a dotted config key or summary field (`a.b[]` -> `a-b`)."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", key.replace("[]", "")).strip("-")


# --------------------------------------------------------------------------------------------------
# config keys


@dataclass
class Key:
    key: str  # dotted
    type: str
    default: str
    flag: str
    description: str

    @property
    def anchor(self) -> str:
        return key_anchor(self.key)


def _type_name(annotation: object) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.|shardlab\.[a-z_.]+\.", "", text)
    text = text.replace("NoneType", "None")
    return text


def config_entries() -> list[Key]:
    from pydantic import BaseModel

    from shardlab.config import RunConfig

    out: list[Key] = []

    def visit(model, prefix):
        for name, field in model.model_fields.items():
            section = field.default_factory if field.default_factory is not None else field.annotation
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            flag = ", ".join([extra["cli"]["flag"], *extra["cli"]["also"]]) if "cli" in extra else ""
            if isinstance(section, type) and issubclass(section, BaseModel):
                out.append(Key(prefix + name, "section", "", flag, (field.description or section.__doc__ or "").strip()))
                visit(section, prefix + name + ".")
                continue
            default = field.default_factory() if field.default_factory is not None else field.default
            out.append(Key(prefix + name, _type_name(field.annotation), _show(default), flag, field.description or ""))
            inner = [a for t in typing.get_args(field.annotation) for a in (t, *typing.get_args(t))]
            for t in inner:  # list[CurriculumStage] | None: the stage's keys
                if isinstance(t, type) and issubclass(t, BaseModel) and t is not type(None):
                    visit(t, prefix + name + "[].")
                    break

    visit(RunConfig, "")
    return out


def config_page() -> str:
    lines = ["# Config keys", "",
             "Generated from the `RunConfig` schema (`shardlab.config`) each time the docs are built. A YAML file given "
             "to `--config` sets any of these keys; nested keys are sections in YAML (`dataset:` then `source:`) and "
             "dotted with `--set` (`--set dataset.source=squad`). Unknown keys and wrong types are "
             "[one-line errors](errors.md). `curriculum[].` keys belong to each stage of a curriculum list.", "",
             "| key | type | default | flag | what it sets |", "|---|---|---|---|---|"]
    for k in config_entries():
        flag = ", ".join(f"`{f.strip()}`" for f in k.flag.split(",")) if k.flag else ""
        lines.append(f'| <a id="{k.anchor}"></a>`{k.key}` | {_cell(k.type)} | {_cell(k.default)} | {flag} | '
                     f"{_cell(k.description)} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# summary.json fields


@dataclass
class SummaryField:
    key: str
    type: str
    description: str

    @property
    def anchor(self) -> str:
        return key_anchor(self.key)


def summary_entries() -> list[SummaryField]:
    from shardlab.measure import summary, summary_fields

    out: list[SummaryField] = []

    def visit(cls, prefix):
        hints = typing.get_type_hints(cls, vars(summary))
        for f in dataclasses.fields(cls):
            if f.name == "extras":
                continue
            key = prefix + f.name
            nested = cls._nested.get(f.name)  # noqa: SLF001 - the records' own map of nested records
            doc = summary_fields.FIELDS.get(key)
            if doc is None and nested is summary.Stat:
                doc = summary_fields.FIELDS.get(key)
            out.append(SummaryField(key, _type_name(hints[f.name]), doc or ""))
            if nested is not None and nested is not summary.Stat:
                is_list = typing.get_origin(typing.get_args(hints[f.name])[0]) is list if typing.get_args(hints[f.name]) else False
                visit(nested, key + ("[]." if is_list else "."))

    visit(summary.RunSummary, "")
    for name, doc in summary_fields.EXTRAS.items():
        out.append(SummaryField(name, "strategy extra", doc))
    return out


def summary_page() -> str:
    from shardlab.measure import summary_fields

    lines = ["# summary.json", "",
             "Generated from the `RunSummary` type (`shardlab.measure.summary`) and its field notes "
             "(`shardlab.measure.summary_fields`) each time the docs are built. A run writes only the keys it has "
             "(a CPU run has no `gpu_mem_peak_gib`); readers keep keys they do not know. GiB = 2^30 bytes; MB in the "
             "monitor's figures = 10^6 bytes, as psrecord writes them.", "",
             "| field | type | meaning |", "|---|---|---|"]
    for f in summary_entries():
        lines.append(f'| <a id="{f.anchor}"></a>`{f.key}` | {_cell(f.type)} | {_cell(f.description)} |')
    stat = [(k.removeprefix("*."), v) for k, v in summary_fields.FIELDS.items() if k.startswith("*.")]
    lines += ["", "A field of type `Stat` (a sampled quantity) holds " +
              "; ".join(f"`{k}`: {v}" for k, v in stat) + "."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# user errors


@dataclass
class UserErrorSite:
    path: str  # relative to src/
    line: int
    function: str
    kind: str  # UserError or a subclass
    cause: str
    fix: str

    @property
    def anchor(self) -> str:
        return slug("err", self.path.removeprefix("shardlab/").removesuffix(".py"), self.function, str(self.index))

    index: int = 0  # the n-th call in that function, for a stable anchor


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    names = {"UserError"}
    while True:
        more = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                and any(getattr(b, "id", getattr(b, "attr", None)) in names for b in node.bases)} - names
        if not more:
            return names
        names |= more


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
    return out


def _placeholder(expr: ast.expr) -> str:
    text = ast.unparse(expr)
    simple = re.fullmatch(r"[\w.]+", text)
    if simple:
        return "‹" + text.split(".")[-1] + "›"
    names = [n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(expr) if isinstance(n, (ast.Name, ast.Attribute))]
    names = [n for n in names if n not in {"self", "cfg", "str", "repr", "len", "join", "int", "float", "Path", "args", "spec",
                                           "map", "sorted", "list", "name"}]
    return "‹" + (names[0] if names else "…") + "›"


def _render(expr: ast.expr | None, consts: dict[str, ast.expr], depth: int = 0) -> str:
    """A message or hint expression as readable text: literals kept, computed parts as ‹name›."""
    if expr is None or depth > 5:
        return ""
    if isinstance(expr, ast.Constant):
        return str(expr.value) if expr.value is not None else ""
    if isinstance(expr, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else _placeholder(v.value) for v in expr.values)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _render(expr.left, consts, depth + 1) + _render(expr.right, consts, depth + 1)
    if isinstance(expr, ast.IfExp):
        return _render(expr.body, consts, depth + 1)
    if isinstance(expr, ast.Name) and expr.id in consts:
        return _render(consts[expr.id], consts, depth + 1)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("format", "replace", "split"):
        base = _render(expr.func.value, consts, depth + 1)
        return base if expr.func.attr != "split" else base.split("\\n")[0]
    if isinstance(expr, ast.Subscript):
        return _render(expr.value, consts, depth + 1)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "join" and expr.args:
        sep = expr.func.value.value if isinstance(expr.func.value, ast.Constant) else ", "
        arg = expr.args[0]
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):  # names + ["literal", ...]
            return sep.join(filter(None, [_render(arg.left, consts, depth + 1), _render(arg.right, consts, depth + 1)]))
        return _render(arg, consts, depth + 1)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return "; ".join(filter(None, [_render(e, consts, depth + 1) for e in expr.elts]))
    return _placeholder(expr)


def error_entries() -> list[UserErrorSite]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted((SRC / "shardlab").rglob("*.py"))}
    classes = _error_classes(trees)
    out: list[UserErrorSite] = []
    for path, tree in trees.items():
        consts = _constants(tree)
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        counts: dict[str, int] = {}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in classes):
                continue
            kind = getattr(node.func, "id", getattr(node.func, "attr", ""))
            kw = {k.arg: k.value for k in node.keywords}
            msg = node.args[0] if node.args else kw.get("message")
            hint = node.args[1] if len(node.args) > 1 else kw.get("hint")
            fn, up = "module", parents.get(node)
            while up is not None:
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = up.name
                    break
                up = parents.get(up)
            cause, fix = _render(msg, consts), _render(hint, consts)
            if isinstance(msg, ast.Attribute) and msg.attr == "message":  # a re-raise of another UserError, reworded
                cause = "(the error of the step it wraps, passed on)"
                fix = fix or "(that error's own fix)"
            out.append(UserErrorSite(str(path.relative_to(SRC)), node.lineno, fn, kind, cause.strip(), fix.strip()))
            # anchors numbered per function, in source order
    out.sort(key=lambda e: (e.path, e.line))
    counts = {}
    for e in out:
        counts[(e.path, e.function)] = counts.get((e.path, e.function), 0) + 1
        e.index = counts[(e.path, e.function)]
    return out


# The errors a newcomer meets first: (title, a phrase of the cause that finds the entries, what it usually means).
COMMON_ERRORS = [
    ("A misspelt key or flag", "unknown config key",
     "a YAML key or `--set` key that `RunConfig` does not have; the fix names the closest real key"),
    ("The output directory holds another run", "already holds",
     "runs never mix files: `--overwrite` replaces the old run, `--resume auto` continues it"),
    ("A model or dataset that is not cached offline", "is not available offline",
     "fetch it once on a machine with network into a shared `HF_HOME` (see the offline how-to)"),
    ("CUDA out of memory", "CUDA out of memory",
     "a smaller micro batch with more accumulation, gradient checkpointing, or a strategy that shards more"),
    ("Not enough host RAM for the plan", "of host RAM on this node",
     "offload strategies keep the optimizer on the host: `--no-pin-memory`, another strategy, or `--force`"),
]


def errors_page() -> str:
    entries = error_entries()
    lines = ["# User errors", "",
             "Every mistake shardlab can name is one line on stderr, `error: CAUSE (fix: FIX)`, with exit status 2 "
             "(3 for CUDA out of memory) and no traceback. This catalogue is generated from the code that raises them "
             "(every `UserError` in `src/`) each time the docs are built: ‹name› marks a part filled in at run time.", "",
             "## The five most common {#most-common}", ""]
    for title, phrase, meaning in COMMON_ERRORS:
        hits = [e for e in entries if phrase.lower() in e.cause.lower()]
        links = ", ".join(f"[`{e.path.removeprefix('shardlab/')}`](#{e.anchor})" for e in hits[:3])
        first = hits[0] if hits else None
        lines += [f"**{title}.** {meaning}.", ""]
        if first:
            lines += [f"- cause: {_cell(first.cause)}", f"- fix: {_cell(first.fix)}", f"- raised in: {links}", ""]
    lines += ["## Every error", ""]
    by_module: dict[str, list[UserErrorSite]] = {}
    for e in entries:
        by_module.setdefault(e.path, []).append(e)
    for path, group in by_module.items():
        lines += [f"### `{path.removeprefix('shardlab/')}`", "", "| cause | fix | raised in |", "|---|---|---|"]
        for e in group:
            kind = "" if e.kind == "UserError" else f" ({e.kind})"
            lines.append(f'| <a id="{e.anchor}"></a>{_cell(e.cause)} | {_cell(e.fix)} | `{e.function}`{kind} |')
        lines.append("")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# the patches of dependencies' internals (a table for docs/concepts/patches.md)


def patches_table() -> str:
    """One row per patch of shardlab.compat.PATCHES: name, what it changes, the versions it was tested on, what runs
    when it is off."""
    from shardlab.compat import PATCHES, SWITCH_ENV

    lines = ["| patch | changes | tested on | scope | off: instead |", "|---|---|---|---|---|"]
    for p in PATCHES.values():
        tested = ", ".join(f"{dist} {spec}" for dist, spec in p.tested)
        lines.append(f"| `{p.name}` | {_cell(p.target)} (`compat/{p.module}.py`) | {_cell(tested)} | {p.scope} | "
                     f"{_cell(p.off)} |")
    return "\n".join(lines) + f"\n\nOff for one run: `{SWITCH_ENV}=-NAME` (several: comma-separated; `-all`: every one).\n"


PAGES = {"reference/cli.md": cli_page, "reference/config.md": config_page, "reference/summary.md": summary_page,
         "reference/errors.md": errors_page}
