"""The configuration reference, generated from the schema: every `section.key` with its type,
default, allowed values, meaning and the rules that name it.

Sources, none of them run: the meaning of a key is its field's comment in `schema.py` (the
comment at the end of the field's line, or the comment lines directly above it; never
both), read from the module's source with `tokenize`; its type and default come from
`dataclasses.fields`; its allowed values from `rules.py`'s single-key tables (CHOICES,
POSITIVE, NON_NEGATIVE); its rules are the messages of the cross-field checks, read from
the source of `rules.py` and of each model family's `_config_errors` (jaxptd/arch/*.py)
with `ast` (an f-string's values shown as `…`, a loop variable over key names as those
keys), plus the families' `options` messages. A
rule belongs to every key it names, and is listed once, under the section of the first key
it names.

`python -m jaxptd.config.reference` prints the markdown (docs/config.md is its output);
`--check FILE` exits 1, naming the first differing line, when FILE is not what it would
print. `describe_keys()` is `python -m jaxptd.train --help`'s list. JAX-free.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

from jaxptd.arch import FAMILIES
from jaxptd.config import rules, schema
from jaxptd.config.schema import Config

ARCH_DIR = Path(rules.__file__).resolve().parents[1] / "arch"
# a key name in text: section.key, not inside a path or a dotted module name
KEY = re.compile(r"(?<![\w./-])(?:%s)\.[a-z_0-9]+\b"
                 % "|".join(f.name for f in dataclasses.fields(Config)))
GENERATE = "python -m jaxptd.config.reference > docs/config.md"
SINGLE_KEY_TABLES = ("CHOICES", "POSITIVE", "NON_NEGATIVE")  # rules.py's; the Allowed column


@dataclasses.dataclass(frozen=True)
class Key:
    """One `section.key` of the reference."""
    name: str  # dotted: "parallel.tensor"
    type: str  # the field's annotation: int, float, str or bool
    default: object
    meaning: str
    allowed: str  # one-key rule: "gpt, llama, bert", "> 0", ">= 0" or ""


# --------------------------------------------------------------------------- the schema


def _field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class name: {field name: its comment}} for every annotated field of every class of
    `source`; a field without a comment maps to ""."""
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(token.start[0])
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = found.setdefault(node.name, {})
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields[item.target.id] = _comment_of(item, comments, code_lines)
    return found


def _comment_of(item: ast.AnnAssign, comments: dict[int, str], code_lines: set[int]) -> str:
    trailing = comments.get(item.end_lineno, "") if item.end_lineno in code_lines else ""
    above, line = [], item.lineno - 1
    while line in comments and line not in code_lines:
        above.insert(0, comments[line])
        line -= 1
    assert not (trailing and above), (
        f"schema.py line {item.lineno}: a field's meaning is its line's comment or the "
        "comment lines above it, not both")
    return trailing or " ".join(above)


def _format_default(value: object) -> str:
    """The default as a YAML value that loads back to it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m.group(1).lstrip('+')}{m.group(2)}", text)
    if value == "":
        return '""'
    return str(value)


def _allowed(name: str) -> str:
    if name in rules.CHOICES:
        return ", ".join(rules.CHOICES[name])
    if name in rules.POSITIVE:
        return "> 0"
    if name in rules.NON_NEGATIVE:
        return ">= 0"
    return ""


def keys() -> list[Key]:
    """Every config key, in the schema's order."""
    comments = _field_comments(Path(schema.__file__).read_text())
    found = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        for f in dataclasses.fields(cls):
            name = f"{section.name}.{f.name}"
            found.append(Key(name, str(f.type), f.default, comments[cls.__name__][f.name],
                             _allowed(name)))
    return found


def describe_keys(width: int = 90) -> str:
    """Every section.key with its type, default and allowed values, and under it its
    meaning: what `python -m jaxptd.train --help` lists."""
    lines, section = [], None
    for key in keys():
        if key.name.split(".")[0] != section:
            section = key.name.split(".")[0]
            lines.append(f"{section}:")
        allowed = f" ({key.allowed})" if key.allowed else ""
        lines.append(f"  {key.name:<30} {key.type:<6} default {key.default!r}{allowed}")
        lines += textwrap.wrap(key.meaning, width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def key_meanings() -> dict[str, str]:
    """{'section.key': what it means}, every key of the config (schema.py's comments)."""
    return {key.name: key.meaning for key in keys()}


# --------------------------------------------------------------------------- the rules


def _message(node: ast.expr, loop_keys: dict[str, list[str]]) -> str | None:
    """An error message's text from its expression: a string, or an f-string with each
    value shown as `…`, but a loop's variable over key names (`loop_keys`) shown as those
    keys (`model.{key}=` over ("moe_ffn", "moe_every") -> `model.moe_ffn, model.moe_every=`);
    None for anything else (a variable, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    text = ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            text += part.value
            continue
        names = loop_keys.get(getattr(part.value, "id", None))
        prefix = re.search(r"\b[a-z]+\.$", text)
        text += f", {prefix.group(0) if prefix else ''}".join(names) if names else "…"
    return text


def _literal_keys(node: ast.expr, scopes: list[ast.AST]) -> list[str] | None:
    """The strings a loop iterates over: a literal tuple, list, set or dict (its keys), or
    a name assigned one in `scopes` (the enclosing function, the module)."""
    if isinstance(node, ast.Name):
        for scope in scopes:
            for stmt in getattr(scope, "body", []):
                if isinstance(stmt, ast.Assign) and any(
                        getattr(t, "id", None) == node.id for t in stmt.targets):
                    return _literal_keys(stmt.value, [])
        return None
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if items is None or not all(isinstance(i, ast.Constant) and isinstance(i.value, str)
                                for i in items):
        return None
    return [i.value for i in items]


def _messages(path: Path, only_in: str | None = None) -> list[str]:
    """The messages of `path`'s `_require(ok, message)` calls, `raise ConfigError(message)`
    and `yield message` statements (inside functions named `only_in` when given). A loop
    over one of rules.py's single-key tables (the Allowed column) gives no key names."""
    tree = ast.parse(path.read_text())
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and (only_in is None or f.name == only_in)]
    found: list[str | None] = []

    def visit(node: ast.AST, function: ast.FunctionDef, loop_keys: dict[str, list[str]]):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            keys = None if getattr(node.iter, "id", None) in SINGLE_KEY_TABLES else \
                _literal_keys(node.iter, [function, tree])
            loop_keys = {**loop_keys, node.target.id: keys} if keys else \
                {k: v for k, v in loop_keys.items() if k != node.target.id}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_require":
            found.append(_message(node.args[1], loop_keys))
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                getattr(node.exc.func, "id", None) == "ConfigError" and node.exc.args:
            found.append(_message(node.exc.args[0], loop_keys))
        elif isinstance(node, ast.Yield) and node.value is not None:
            found.append(_message(node.value, loop_keys))
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef):  # each function is its own walk
                visit(child, function, loop_keys)

    for function in functions:
        visit(function, function, {})
    return list(dict.fromkeys(m for m in found if m))


def _tidy(message: str) -> str:
    """`model.x=…: rule` -> `model.x: rule`: the value a message names is the user's."""
    message = re.sub(r"(\b[a-z]+\.(?:[a-z_0-9]+|…))=(?:…|\{value(?:!r)?\})", r"\1", message)
    return re.sub(r"\s+", " ", message).strip()


def rule_messages() -> list[str]:
    """Every cross-field rule's message naming at least one key: rules.py's, each model
    family's `_config_errors` and `options`; in that order, each once."""
    found = _messages(Path(rules.__file__))
    for path in sorted(ARCH_DIR.glob("*.py")):
        found += _messages(path, only_in="_config_errors")
    for family in FAMILIES.values():
        found += list(family.options.values())
    known = {key.name for key in keys()}
    return [m for m in dict.fromkeys(_tidy(m) for m in found) if _named_keys(m, known)]


def _named_keys(text: str, known: set[str]) -> list[str]:
    """The config keys a text names, in order, each once."""
    return [name for name in dict.fromkeys(KEY.findall(text)) if name in known]


def key_rules() -> dict[str, list[str]]:
    """{'section.key': the rule messages that name it}, every key (most have none)."""
    by_key: dict[str, list[str]] = {key.name: [] for key in keys()}
    for message in rule_messages():
        for name in _named_keys(message, set(by_key)):
            by_key[name].append(message)
    return by_key


# --------------------------------------------------------------------------- markdown


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code_keys(text: str, known: set[str]) -> str:
    """The `known` key names in a text (with the value it gives them: `model.arch=bert`) as
    code."""
    def code(m: re.Match) -> str:
        return f"`{m.group(0)}`" if m.group(0).partition("=")[0] in known else m.group(0)
    return re.sub(KEY.pattern + r"(?:=[\w.-]*\w)?", code, text)


INTRO = f"""\
# Configuration reference

Generated from `jaxptd/config/schema.py` (each key's comment there is its meaning) and
`jaxptd/config/rules.py` by `{GENERATE}`; edit those, not this page
(`tests/test_docs.py` fails when the two disagree).

A YAML file holds only what differs from these defaults, as sections (`model:`,
`parallel:`, ...); any key can be overridden on the command line as `section.key=value`
(`parallel.tensor=4`). Values are read as the key's type. Every rule below is checked
before any device work; a broken one is one line, `error:` naming the key, the value and
the rule, and exit status 2. `python -m jaxptd.train --help` lists the keys too.
`runtime.platform`, the old name of `runtime.target`, is still read.

Allowed: the values a key may take on its own (a list of choices, `> 0`, `>= 0`); the rules
after each section's table name the keys they tie together, and a rule is listed under the
section of the first key it names.
"""


def render_markdown() -> str:
    """The reference page (docs/config.md): a table per section, then its rules."""
    all_keys, messages = keys(), rule_messages()
    known = {key.name for key in all_keys}
    first_section = {m: _named_keys(m, known)[0].split(".")[0] for m in messages}
    out = [INTRO]
    for section in dataclasses.fields(Config):
        out += [f"## {section.name}", "", "| key | type | default | allowed | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for key in (k for k in all_keys if k.name.startswith(section.name + ".")):
            allowed = f"`{_cell(key.allowed)}`" if key.allowed else ""
            out.append(f"| `{key.name}` | {key.type} | `{_cell(_format_default(key.default))}` "
                       f"| {allowed} | {_cell(_code_keys(key.meaning, known))} |")
        own = [m for m in messages if first_section[m] == section.name]
        if own:
            out += ["", "Rules:", ""] + [f"- {_code_keys(m, known)}" for m in own]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.config.reference",
        description="Print the configuration reference (markdown) generated from the "
                    "config schema and rules; with --check FILE, compare FILE with it.")
    parser.add_argument("--check", metavar="FILE",
                        help="exit 1 if FILE differs from the generated reference")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    try:
        written = Path(args.check).read_text()
    except OSError as e:
        print(f"error: {args.check}: {e.strerror}", file=sys.stderr)
        return 2
    if written == text:
        return 0
    old, new = written.splitlines(), text.splitlines()
    line = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    print(f"{args.check}: differs from the config schema at line {line + 1}; regenerate it: "
          f"{GENERATE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
