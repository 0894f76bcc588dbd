"""The README's and the docs pages' claims, checked against the program they describe.

Fast: the README is short (under MAX_README_LINES); every `python -m jaxptd.X` command and
`--flag` the README and docs/ name against that CLI's `--help`; every `section.key=value`
they name against the config; the install, train and test sections against
`pyproject.toml` and `.ci/run`; the default config's description against
`configs/gpt_tiny.yaml`. (docs/config.md against the schema, and the links between the
pages: tests/test_docs.py.)

Slow, one run: the README's train command as written, in a scratch directory that holds
the checkout's `configs/` (so the README's relative paths are the run's), then the
`generate` command of docs/models.md and the `checkpoint inspect` command of
docs/checkpoints.md on what it wrote. Against it: the final validation loss is 0.5 nats
below the corpus's unigram entropy; the README's measured table; its sample output's
lines. What the program decides (the steps logged, paths, token counts, the state's size,
the bubble) must be equal; what the machine decides (times, throughput, compiled
temporaries, compressed checkpoint sizes) only keeps its format; losses are equal to the
digits shown, give or take DRIFT, when the corpus is the one the README measured.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import optimised_env
from jaxptd.config import CHOICES, Config, load_config
from jaxptd.data import read_meta, resolve_corpus, unigram_entropy

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# The README and the docs pages, by their path in the repository.
DOCS = {"README.md": README, **{f"docs/{p.name}": p.read_text()
                                for p in sorted((REPO / "docs").glob("*.md"))}}
MAX_README_LINES = 250  # a newcomer reads it in five minutes; the rest lives in docs/
CHECKOUT = "/path/to/jaxptd"  # how the README's sample output writes the checkout's path
# Losses (and perplexities) are compared to the digits the README shows, give or take
# DRIFT (scaled by the perplexity for a perplexity). Runs that differ only in rounding (the
# default config at (data 4, tensor 2) instead of (2, 4), or with XLA's unoptimised code
# generation: the kind of difference another CPU or XLA version makes) stayed within 1e-4
# of each other at every logged step of the 300 (largest 7e-5, measured 2026-11-25).
# DRIFT is about 30 times that, and under what the model's changes of 2026-11-25 moved
# (the final validation loss from 2.29 to 2.31). On another corpus (another Python's
# standard library) other batches and documents give other losses (a changed seed alone
# moved single-batch training losses by up to 0.31): not compared.
DRIFT = 0.002


def close(shown: str, real: float, scale: float = 1.0) -> bool:
    """Whether the README's number `shown` is `real` to its last digit, give or take
    DRIFT x scale."""
    decimals = len(shown.partition(".")[2])
    return abs(float(shown) - real) <= 0.5 * 10.0 ** -decimals + DRIFT * scale


# Flags the pages name for other programs.
FOREIGN_FLAGS = {"--append-eod": "Megatron-LM's tools/preprocess_data.py",
                 "--signal": "SLURM's sbatch", "--nodes": "SLURM's sbatch",
                 "--time": "SLURM's sbatch", "--requeue": "SLURM's sbatch",
                 "--wait": "SLURM's srun"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


# --------------------------------------------------------------------------- reading the README


def sections(page: str = "README.md") -> list[tuple[str, str]]:
    """(heading text, body) for every heading of any level of a page, in order."""
    parts = re.split(r"^#+ (.*)\n", DOCS[page], flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def section(start: str, page: str = "README.md") -> str:
    bodies = [body for heading, body in sections(page) if heading.startswith(start)]
    assert len(bodies) == 1, f"{page}: no single section {start!r}"
    return bodies[0]


def code_blocks(body: str) -> list[list[str]]:
    """The indented code blocks of a section body, each as its lines (4 spaces removed,
    a line ending in a backslash joined with the next)."""
    blocks, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("    "):
            current.append(line[4:])
        elif current:
            blocks.append(_join_continuations(current))
            current = []
    return blocks


def _join_continuations(lines: list[str]) -> list[str]:
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
    return joined


def prose(body: str) -> str:
    """A section body without its code blocks, lines joined (code spans may wrap)."""
    return " ".join(line for line in body.splitlines() if not line.startswith("    "))


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def strip_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line)


# jaxptd's CLIs by the short names the README uses in prose (`plan --verify`).
SHORT_NAMES = {"train": "jaxptd.train", "plan": "jaxptd.plan", "generate": "jaxptd.generate",
               "hf": "jaxptd.hf", "checkpoint": "jaxptd.checkpoint",
               "schedules": "jaxptd.pipeline.schedules", "prepare": "jaxptd.data.prepare"}


def is_command(text: str) -> bool:
    """A command line or span: an interpreter, pip or a script path first (after
    VAR=value assignments), or a jaxptd CLI by its short name with flags (`plan --verify`)."""
    return bool(re.match(r"(\w+=\S*\s+)*(python3?|pip|[\w.-]*/[\w./-]+)\s", text) or
                re.match(rf"({'|'.join(SHORT_NAMES)})\s+--", text))


def jaxptd_command(text: str) -> tuple[str, tuple[str, ...], list[str]] | None:
    """(module, subcommand or (), tokens after them) of a `python -m jaxptd.X ...` command
    (or a short-name one); None for other programs' commands."""
    tokens = shlex.split(text)
    if tokens and tokens[0] in SHORT_NAMES:
        module, rest = SHORT_NAMES[tokens[0]], tokens[1:]
    else:
        starts = [i for i, t in enumerate(tokens[:-1])
                  if t == "-m" and tokens[i + 1].startswith("jaxptd.")]
        if not starts:
            return None
        module, rest = tokens[starts[0] + 1], tokens[starts[0] + 2:]
    sub = tuple(rest[:1]) if rest and rest[0] in subcommands(module) else ()
    return module, sub, rest[len(sub):]


def commands(body: str) -> list[str]:
    """Every command of a section: code-block lines and command spans."""
    lines = [strip_comment(line) for block in code_blocks(body) for line in block]
    return [c for c in lines + [s for s in spans(prose(body)) if is_command(s)]
            if is_command(c + " ")]


@functools.lru_cache(maxsize=None)
def cli_help(module: str, sub: tuple[str, ...] = ()) -> str:
    result = subprocess.run([sys.executable, "-m", module, *sub, "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        f"python -m {module} {' '.join(sub)} --help: {result.stderr[-2000:]}"
    return result.stdout


def subcommands(module: str) -> set[str]:
    usage = re.search(r"\{([\w,-]+)\}", cli_help(module))
    return set(usage.group(1).split(",")) if usage else set()


def accepts(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def config_keys() -> dict[str, object]:
    """'section.key' -> default, from the Config dataclasses."""
    defaults = Config()
    return {f"{s.name}.{k.name}": getattr(getattr(defaults, s.name), k.name)
            for s in dataclasses.fields(Config) for k in dataclasses.fields(s.default_factory)}


# --------------------------------------------------------------------------- fast checks


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_every_cli_command_and_flag_the_pages_name_is_accepted():
    """A `python -m jaxptd.X` command's flags are in its --help; a flag named in prose is
    in the --help of a jaxptd CLI some command of its page names (or of jaxptd.train),
    unless it is another program's (FOREIGN_FLAGS). Every CLI is named somewhere."""
    problems, seen = [], set()
    for page in DOCS:
        helps = [cli_help("jaxptd.train")]
        for heading, body in sections(page):
            for command in commands(body):
                parsed = jaxptd_command(command)
                if parsed is None:
                    continue
                module, sub, rest = parsed
                seen.add(module)
                helps.append(cli_help(module, sub))
                problems += [f"{page}, {heading}: {flag} in `{command}`"
                             for flag in FLAG.findall(" ".join(rest))
                             if not accepts(cli_help(module, sub), flag)]
        for heading, body in sections(page):
            for text in spans(prose(body)):
                if is_command(text):
                    continue
                problems += [f"{page}, {heading}: {flag} in `{text}`"
                             for flag in FLAG.findall(text) if flag not in FOREIGN_FLAGS
                             and not any(accepts(h, flag) for h in helps)]
    assert not problems, "flags no CLI accepts:\n" + "\n".join(problems)
    assert {"jaxptd.train", "jaxptd.data.prepare", "jaxptd.hf", "jaxptd.generate",
            "jaxptd.checkpoint", "jaxptd.pipeline.schedules", "jaxptd.plan"} <= seen, seen


def test_every_override_the_pages_name_is_a_key_and_a_valid_choice():
    """`section.key=value` anywhere in the README and docs (commands, spans): a real key,
    and for a key with a fixed set of values one of them (placeholders such as N, DIR
    skipped)."""
    keys = config_keys()
    found = [(page, key, value) for page, text in DOCS.items() for key, value in
             re.findall(r"(?<![\w./-])([a-z]+\.[a-z_0-9]+)=([^\s`|,)]*)", text)]
    assert len(found) > 20, found
    for page, key, value in found:
        if key == "section.key":
            continue
        assert key in keys, f"{page} names {key}={value}: no such config key"
        if key in CHOICES and value and not value.isupper() and value != "...":
            assert value in CHOICES[key], f"{page} names {key}={value}: not one of {CHOICES[key]}"


def test_install_section_matches_the_package():
    """The Python version is pyproject's; the install line's extras exist and the
    paragraph after it names every dependency they install (a pin with its version)."""
    import tomllib
    body = section("Install")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    oldest = re.search(r"Python (3\.\d+) or newer", prose(body)).group(1)
    assert project["requires-python"] == f">={oldest}", project["requires-python"]
    install = [line for line in code_blocks(body)[0] if line.startswith("pip install")]
    assert len(install) == 1, code_blocks(body)
    extras = re.fullmatch(r"pip install -e '\.\[([\w,]+)\]'", install[0]).group(1).split(",")
    assert set(extras) <= set(project["optional-dependencies"]), extras
    paragraph = next(prose(p) for p in body.split("\n\n") if "The last command installs" in p)
    for requirement in project["dependencies"] + [r for e in extras
                                                  for r in project["optional-dependencies"][e]]:
        name = re.split(r"[<>=~! \[;]", requirement)[0]
        shown = requirement if "==" in requirement else name  # a pin is part of the claim
        assert re.search(rf"(?<![\w-]){re.escape(shown)}(?![\w-])", paragraph), \
            f"the README's install paragraph does not name {shown}"


def test_test_section_matches_ci_and_the_markers():
    """The test command is the one .ci/run runs; the fast subset deselects a marker
    pyproject.toml declares."""
    import tomllib
    body = section("Test")
    test = code_blocks(body)[0][0]
    assert test in (REPO / ".ci" / "run").read_text().splitlines(), test
    subset = re.search(r'`python -m pytest -q -m "not (\w+)"`', prose(body)).group(1)
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["markers"]
    assert any(m.startswith(f"{subset}:") for m in markers), (subset, markers)


def test_train_section_matches_the_default_config():
    """The default config's description (layers, hidden size, parameters, devices, layout,
    corpus, run directory) is configs/gpt_tiny.yaml's; its example of scaling is a valid
    config."""
    body = section("Train")
    train = code_blocks(body)[0]
    assert len(train) == 1, train
    config_path = re.fullmatch(r"python -m jaxptd\.train --config (\S+)", train[0]).group(1)
    config = load_config(str(REPO / config_path))
    text = prose(body)
    described = re.search(
        r"trains a (\d+)-layer GPT \(hidden (\d+), ([\d.]+)M parameters\) on \*\*(\d+) "
        r"simulated CPU devices laid out as \(data (\d+), pipe (\d+), tensor (\d+)\)\*\*", text)
    assert described, "the default config's description changed form: update this test"
    layers, hidden, millions, devices, data, pipe, tensor = described.groups()
    par = config.parallel
    assert (config.model.arch, int(layers), int(hidden)) == \
        ("gpt", config.model.num_layers, config.model.hidden_size), described.group(0)
    assert (int(devices), int(data), int(pipe), int(tensor)) == \
        (config.num_devices, par.data, par.pipe, par.tensor), described.group(0)
    assert float(millions) == round(parameter_count(config) / 1e6, 2), parameter_count(config)
    assert f"`data.path: {config.data.path}`" in text
    assert f"into `{config.train.run_dir}/`" in text
    assert f"checkpoints to `{config.checkpoint_dir}`" in text
    example = re.search(r"scales by changing numbers, e\.g\. `([^`]+)`", text).group(1)
    load_config(str(REPO / config_path), example.split())  # raises if invalid


def parameter_count(config) -> int:
    """The model's parameters at its own vocabulary (without the padding for tensor
    parallelism, which holds zeros), from an abstract initialisation."""
    import jax
    from jaxptd import model as models
    params = jax.eval_shape(functools.partial(models.get(config.model).init_params,
                                              config.model, config.model.vocab_size),
                            jax.random.key(0))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


# --------------------------------------------------------------------------- the default run

# The line forms of a run's console output. Named groups: x_* must be equal, l_* are losses
# (close() on the README's corpus), p_* perplexities (likewise, DRIFT scaled); the
# rest of a line only keeps its format.
CLOCK = r"\d+(?::\d\d){1,2}"
SIZE = r"\d+(?:\.\d)? [KMGT]?B"
FORMS = {
    "compiled": rf"compiled the step in \d+\.\d s: (?P<x_state>{SIZE}) of state and {SIZE} "
                r"of temporaries per device, pipeline bubble (?P<x_bubble>\d\.\d{3})",
    "progress": rf"(?P<x_head>step +\d+/\d+ \( *\d+%\))  loss (?P<l_loss>\d+\.\d{{4}})  "
                rf"\d[\d.]*[kMG]? tok/s  elapsed {CLOCK}  left {CLOCK}",
    "validation": r"(?P<x_head>step \d+): validation loss (?P<l_loss>\d+\.\d{4}), "
                  r"perplexity (?P<p_ppl>\d+\.\d\d)",
    "checkpoint": rf"(?P<x_head>checkpoint: step \d+) saved in \d+\.\d s \({SIZE}\) to "
                  r"(?P<x_path>\S+)",
    "done": rf"done: (?P<x_head>step \d+/\d+, \d+ steps \(\S+ tokens\)) trained in {CLOCK}; "
            r"best val loss (?P<l_best>\d+\.\d{4}) (?P<x_best>\(step \d+\)); files in "
            r"(?P<x_files>.+)",
}


def parse_line(line: str) -> tuple[str, dict[str, str]] | None:
    for kind, form in FORMS.items():
        match = re.fullmatch(form, line)
        if match:
            return kind, match.groupdict()
    return None


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's train command as written, run in a scratch directory that
    holds the checkout's configs/; the corpus is prepared into a fresh cache."""
    checkout = tmp_path_factory.mktemp("checkout")
    (checkout / "configs").symlink_to(REPO / "configs")
    cache = tmp_path_factory.mktemp("jaxptd-cache")
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = optimised_env(dict(os.environ, JAXPTD_CACHE=str(cache), PYTHONPATH=pythonpath))
    train = [c for c in code_blocks(section("Train"))[0]
             if c.startswith("python -m jaxptd.train")]
    assert len(train) == 1, train
    result = run(train[0], checkout, env, timeout=900)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPTD_CACHE", str(cache))
        corpus = resolve_corpus("pystdlib")  # the run prepared it
    config = load_config(str(REPO / shlex.split(train[0])[-1]))
    return SimpleNamespace(checkout=checkout, env=env, result=result, corpus=corpus,
                           config=config, run_dir=checkout / config.train.run_dir)


def run(command: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """A README command line, `python` being this interpreter; it must succeed."""
    argv = shlex.split(command)
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        f"{command}: exit {result.returncode}\n{result.stderr[-3000:]}"
    return result


def records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def readme_corpus() -> dict:
    """What the measured table says of its corpus."""
    described = re.search(
        r"The corpus: Python (\S+)'s standard library, (\d+) training and (\d+) validation "
        r"tokens, unigram entropy (\d\.\d\d) nats \(train split\), (\d\.\d\d) nats "
        r"\(validation split\)", prose(section("Measured: the default config")))
    assert described, "the measured table's corpus sentence changed form: update this test"
    version, train, val, h_train, h_val = described.groups()
    return {"python": version, "train_tokens": int(train), "val_tokens": int(val),
            "entropy": {"train": float(h_train), "val": float(h_val)}}


def same_corpus(corpus: str) -> bool:
    """Whether the run's corpus is the one the README measured (the Python version the
    stdlib came from and both splits' token counts)."""
    meta, readme = read_meta(corpus), readme_corpus()
    return (f"Python {readme['python']} " in meta["source"] and
            (meta["train_tokens"], meta["val_tokens"]) ==
            (readme["train_tokens"], readme["val_tokens"]))


@pytest.mark.slow
def test_default_config_learns_below_unigram_entropy(readme_run):
    """configs/gpt_tiny.yaml's whole run ends 0.5 nats below the corpus's unigram
    entropy (the validation split's)."""
    vals = [r for r in records(readme_run.run_dir) if "val_loss" in r]
    assert vals, readme_run.result.stdout[-3000:]
    entropy = unigram_entropy(readme_run.corpus, "val")
    assert vals[-1]["step"] == readme_run.config.train.steps
    assert vals[-1]["val_loss"] < entropy - 0.5, (vals[-1], entropy)


@pytest.mark.slow
def test_run_prints_what_the_readme_shows(readme_run):
    """Every console line past the start-up has one of the forms the README shows; one
    progress line per train.log_every steps, a validation line per train.eval_every, a
    checkpoint line per checkpoint.every naming the step's absolute path, the summary
    last, nothing on stderr; every line of the README's sample is the run's line of that
    kind and step, equal but for the machine's numbers (and losses close())."""
    config, result = readme_run.config, readme_run.result
    assert result.stderr == "", result.stderr[-3000:]
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("compiled the step"))
    parsed = [parse_line(line) for line in lines[first:]]
    assert all(parsed), [line for line, p in zip(lines[first:], parsed) if p is None]
    by_kind: dict[str, list[dict]] = {}
    for kind, fields in parsed:
        by_kind.setdefault(kind, []).append(fields)

    steps = config.train.steps
    checkout = os.path.realpath(readme_run.checkout)
    ckpt_dir = os.path.join(checkout, config.checkpoint_dir)
    width = len(str(steps))
    assert [f["x_head"] for f in by_kind["progress"]] == [
        f"step {s:>{width}}/{steps} ({100 * s / steps:3.0f}%)"
        for s in range(config.train.log_every, steps + 1, config.train.log_every)]
    assert [f["x_head"] for f in by_kind["validation"]] == [
        f"step {s}" for s in range(config.train.eval_every, steps + 1, config.train.eval_every)]
    every = config.checkpoint.every
    assert [(f["x_head"], f["x_path"]) for f in by_kind["checkpoint"]] == [
        (f"checkpoint: step {s}", f"{ckpt_dir}/{s}") for s in range(every, steps + 1, every)]
    assert len(by_kind["compiled"]) == len(by_kind["done"]) == 1 and parsed[-1][0] == "done"

    block = code_blocks(section("Train"))[1]
    sample = [line.replace(CHECKOUT, checkout) for line in block if line != "..."]
    compare_losses = same_corpus(readme_run.corpus)
    for line in sample:
        shown = parse_line(line)
        assert shown, f"README sample line of no known form: {line!r}"
        kind, fields = shown
        real = [f for f in by_kind[kind] if f.get("x_head") == fields.get("x_head")]
        assert len(real) == 1, f"README sample line not in the run's output: {line!r}"
        for name, value in fields.items():
            if name.startswith("x_"):
                assert real[0][name] == value, (line, name, real[0][name])
            elif compare_losses:
                real_value = float(real[0][name])
                scale = real_value if name.startswith("p_") else 1.0
                assert close(value, real_value, scale), \
                    (f"README sample {line!r}: {name} is {real[0][name]} in the run; "
                     "re-measure the README's default-config table and samples")


@pytest.mark.slow
def test_measured_table_matches_the_run(readme_run):
    """The table's rows are steps the run logged; on the README's corpus, its entropies
    are the corpus's and its losses and perplexities the run's (close())."""
    body = section("Measured: the default config")
    rows = [[cell.strip().strip("*") for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines() if re.match(r"\| \d", line)]
    assert rows and all(len(row) == 4 for row in rows), rows  # step, train, val, perplexity
    logged = {(r["step"], "loss" if "loss" in r else "val"): r for r in records(readme_run.run_dir)
              if "loss" in r or "val_loss" in r}
    for step, train, val, ppl in rows:
        assert (int(step), "loss") in logged and (not val or (int(step), "val") in logged), step
    readme = readme_corpus()
    tokens = f"{(readme['train_tokens'] + readme['val_tokens']) / 1e6:.1f}M byte-level tokens"
    assert tokens in prose(section("Train")), tokens
    if not same_corpus(readme_run.corpus):
        pytest.skip(f"the corpus is not the README's ({read_meta(readme_run.corpus)['source']}"
                    "): its losses are not compared")
    for split in ("train", "val"):
        entropy = unigram_entropy(readme_run.corpus, split)
        assert round(entropy, 2) == readme["entropy"][split], (split, entropy)
    wrong = []
    for step, train, val, ppl in rows:
        step = int(step)
        pairs = [(train, logged[step, "loss"]["loss"], 1.0)]
        if val:
            real = logged[step, "val"]
            pairs += [(val, real["val_loss"], 1.0), (ppl, real["val_ppl"], real["val_ppl"])]
        wrong += [(step, shown, real) for shown, real, scale in pairs
                  if not close(shown, real, scale)]
    assert not wrong, f"re-measure the README's default-config table: (step, README, run) {wrong}"


@pytest.mark.slow
def test_generate_and_inspect_commands_run_on_the_default_run(readme_run):
    """The README's generate command, on the run the set-up trained, prints text that
    starts with the prompt, then its ids as a JSON list on the last line (the README's
    sample starts with the prompt too; the sampled text itself is not compared: one
    rounding difference in the logits changes a draw and every draw after it);
    `checkpoint inspect` on the run directory exits 0 and names the step a run resumes
    from."""
    body = section("Generating text", "docs/models.md")
    generate = next(c for c in commands(body) if c.startswith("python -m jaxptd.generate"))
    tokens = shlex.split(generate)
    prompt = tokens[tokens.index("--prompt") + 1]
    new_tokens = int(tokens[tokens.index("--max-new-tokens") + 1])
    out = run(generate, readme_run.checkout, readme_run.env, timeout=300).stdout
    text, ids = out.rstrip("\n").rsplit("\n", 1)
    ids = json.loads(ids)
    assert text.startswith(prompt), text
    assert 0 < len(ids) <= new_tokens and all(0 <= i < readme_run.config.model.vocab_size
                                             for i in ids), ids
    assert code_blocks(body)[1][0].startswith(prompt)

    inspect = next(c for c in commands(section("Damaged checkpoints", "docs/checkpoints.md"))
                   if "jaxptd.checkpoint inspect" in c)
    run_dir = os.path.relpath(readme_run.run_dir, readme_run.checkout)
    out = run(inspect.replace("DIR", run_dir), readme_run.checkout, readme_run.env, 120).stdout
    assert f"a run resumes from step {readme_run.config.train.steps}" in out, out
