"""The documentation against what it documents, fast (no JAX work).

- docs/config.md is what `python -m jaxptd.config.reference` generates from the config
  schema and rules (so a key added, removed, renamed, re-defaulted or given another
  comment without regenerating it fails here); every key has a meaning; the defaults it
  shows load back as the defaults; the rules it lists are the messages users get (checked
  on broken configs).
- Every docs/ page is linked from the README and every relative link in the README, the
  docs pages and BENCHMARKS.md resolves, to a file and, with a `#fragment`, to a heading of
  it (GitHub's anchors).
- The schedule pictures in docs/schedules.md are what the schedules CLI prints.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxptd.config import Config, ConfigError, load_config
from jaxptd.config import reference

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


# --------------------------------------------------------------------------- the reference


def test_config_reference_is_the_generated_one():
    """docs/config.md equals the reference generated from schema.py and rules.py, and the
    CLI's --check says so (exit 0), and exits 1 naming the file for a changed copy."""
    written = (DOCS / "config.md").read_text()
    assert written == reference.render_markdown(), (
        f"docs/config.md is stale: regenerate it with {reference.GENERATE}")
    check = [sys.executable, "-m", "jaxptd.config.reference", "--check"]
    result = subprocess.run([*check, "docs/config.md"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_config_reference_check_fails_on_a_changed_file(tmp_path):
    changed = tmp_path / "config.md"
    text = reference.render_markdown()
    changed.write_text(text.replace("| `model.num_layers` |", "| `model.layers` |"))
    result = subprocess.run([sys.executable, "-m", "jaxptd.config.reference", "--check",
                             str(changed)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and str(changed) in result.stderr, result.stderr


def test_every_key_has_a_meaning_type_and_default():
    """key_meanings() has every section.key of Config, each with a comment in schema.py;
    the reference's rows name each key once, with its dataclass type."""
    expected = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
                for f in dataclasses.fields(s.default_factory)]
    meanings = reference.key_meanings()
    assert list(meanings) == expected
    assert [k for k, meaning in meanings.items() if not meaning.strip()] == [], \
        "schema.py fields without a comment"
    rows = re.findall(r"^\| `([a-z]+\.[a-z_0-9]+)` \| (\w+) \|", reference.render_markdown(), re.M)
    assert [key for key, _ in rows] == expected
    assert all(kind in ("int", "float", "str", "bool") for _, kind in rows), rows


def test_reference_defaults_load_back():
    """Each default as the reference shows it, given as an override, is the default."""
    defaults = Config()
    for key in reference.keys():
        section, name = key.name.split(".")
        shown = reference._format_default(key.default)
        loaded = getattr(getattr(load_config(None, [f"{key.name}={shown}"]), section), name)
        assert loaded == getattr(getattr(defaults, section), name), (key.name, shown, loaded)


# A broken config for some of the rules: (overrides, the key whose rules must hold the message)
BROKEN = [
    (["model.hidden_size=130"], "model.hidden_size"),
    (["parallel.tensor=3", "runtime.cpu_devices=3"], "model.num_heads"),
    (["parallel.fsdp_group=2"], "parallel.fsdp_group"),
    (["parallel.data=2", "train.global_batch=15", "runtime.cpu_devices=2"], "train.global_batch"),
    (["parallel.pipe=2", "offload.activations=true", "runtime.cpu_devices=2"],
     "offload.activations"),
    (["model.dtype=float16"], "model.dtype"),
    (["model.arch=gpt", "model.num_kv_heads=2"], "model.num_kv_heads"),
    (["model.moe_every=2"], "model.moe_every"),
    (["model.arch=bert", "model.seq_len=4"], "model.seq_len"),
    (["model.arch=llama", "model.rope_factor=4"], "model.rope_factor"),
]


KEYS = r"[a-z]+\.[a-z_0-9]+(?:, [a-z]+\.[a-z_0-9]+)*"  # a key, or a list of keys


def matches(template: str, message: str) -> bool:
    """Whether a raised message is the reference's rule `template`: its `…` any text, a key
    it names (or any one of a list of keys: a rule of each) followed by any `=value`."""
    pattern = ""
    for part in re.split(rf"(…|\b{KEYS}\b)", template):
        if part == "…":
            pattern += ".+?"
        elif re.fullmatch(KEYS, part):
            pattern += "(?:" + "|".join(map(re.escape, part.split(", "))) + r")(?:=\S+?)?"
        else:
            pattern += re.escape(part)
    return re.fullmatch(pattern, message) is not None


@pytest.mark.parametrize("overrides, key", BROKEN)
def test_reference_rules_are_the_errors_users_get(overrides, key):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    message = str(raised.value)
    rules = reference.key_rules()[key]
    assert any(matches(rule, message) for rule in rules), (message, rules)


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces
    to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.*)$", path.read_text(), re.M):
        base = slug(heading)
        n = found.get(base, 0)
        found[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"^    .*$", "", path.read_text(), flags=re.M)  # not in code blocks
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target)]  # relative ones


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(REPO / "README.md")
              if target.startswith("docs/")}
    pages = {p.resolve() for p in DOCS.glob("*.md")}
    assert pages, "no docs/ pages"
    assert sorted(p.name for p in pages - linked) == [], "docs pages the README does not link"
    assert sorted(str(p) for p in linked - pages) == [], "README links to missing docs pages"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        file, _, fragment = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(target)
        elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
            broken.append(target)
    assert broken == [], f"{page.name}: links that resolve to nothing"


def test_readme_links_documentation_pages_for_every_topic():
    """The README's documentation list names a page for each topic the README promises."""
    text = (REPO / "README.md").read_text()
    for page in ("layouts", "schedules", "memory", "models", "long-context", "moe",
                 "checkpoints", "multihost", "planner", "config", "data"):
        assert f"(docs/{page}.md)" in text, page


# --------------------------------------------------------------------------- pictures


def schedule_pictures() -> list[tuple[str, list[str]]]:
    """(command, the lines printed under it) of docs/schedules.md's indented blocks that
    start with a schedules command and show its output."""
    blocks, current = [], []
    for line in (DOCS / "schedules.md").read_text().splitlines() + [""]:
        if line.startswith("    "):
            current.append(line[4:])
        elif current:
            blocks.append(current)
            current = []
    return [(b[0], b[1:]) for b in blocks
            if b[0].startswith("python -m jaxptd.pipeline.schedules") and len(b) > 1
            and not b[0].endswith("\\")]


def test_schedule_pictures_are_what_the_cli_prints():
    pictures = schedule_pictures()
    kinds = {command.split("--kind ")[1].split()[0] for command, _ in pictures}
    assert {"gpipe", "1f1b", "interleaved", "zb-h1"} <= kinds, kinds
    for command, shown in pictures:
        argv = command.split()[1:]
        printed = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout
        assert [line.rstrip() for line in printed.splitlines()] == shown, command
