"""Where the Hugging Face bridge (jaxptd/hf/bridge.py) touches the file system: reading a
transformers directory (config.json and *.safetensors, never pickle), writing an output
directory whole or not at all, and I/O failures as one line.

Invariants: an output directory is checked (`check_target`) before anything is read or
written, and refused when it holds anything unless the user asked to overwrite it; it is
written into a staging directory beside it that then takes its place (`publish`), at the
modes the umask gives. Every OSError (and safetensors' own error) of a read or write goes
through `io_errors`, which says what failed, why and what to do, as an `HFError`.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from jaxptd.arch import HF_CLASSES
from jaxptd.hf.names import HFError, require


def read_hf(hf_dir: str) -> tuple[str, dict, dict]:
    """(architecture, config.json dict, {name: numpy tensor}) of a transformers directory."""
    from safetensors.numpy import load_file

    config_path = Path(hf_dir, "config.json")
    require(config_path.is_file(), f"{hf_dir}: no config.json (expected a transformers "
            "checkpoint directory: config.json and *.safetensors)")
    with io_errors("reading", config_path):
        text = config_path.read_bytes()
    try:
        hf = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{config_path}: not valid JSON ({e}): download or save it again") \
            from None
    require(isinstance(hf, dict), f"{config_path}: not a JSON object of settings")
    arch = (hf.get("architectures") or ["?"])[0]
    require(arch in HF_CLASSES, f"{config_path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(HF_CLASSES)})")
    tokens = {key: token for key, token in HF_CLASSES[arch].tokens.items()
              if hf.get(key) is None}
    hf = {**hf, **_token_ids(Path(hf_dir), tokens)} if tokens else hf
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    require(bool(files), f"{hf_dir}: no *.safetensors files (pickled checkpoints are not "
            "read; save with safe_serialization=True)")
    tensors = {}
    for file in files:
        with io_errors("reading", file):
            tensors.update(load_file(file))
    return arch, hf, tensors


def _token_ids(hf_dir: Path, tokens: dict) -> dict:
    """{config key: id} of the `tokens` ({config key: token}) that the directory's
    tokenizer names: tokenizer.json's added tokens and vocabulary, else vocab.txt's lines
    (a WordPiece vocabulary: BERT's)."""
    vocab: dict = {}
    if (hf_dir / "tokenizer.json").is_file():
        with io_errors("reading", hf_dir / "tokenizer.json"):
            text = (hf_dir / "tokenizer.json").read_bytes()
        try:
            tokenizer = json.loads(text)
            model_vocab = tokenizer.get("model", {}).get("vocab")
            vocab = dict(model_vocab) if isinstance(model_vocab, dict) else {}
            vocab.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
        except (ValueError, AttributeError, KeyError, TypeError) as e:
            raise HFError(f"{hf_dir / 'tokenizer.json'}: not a tokenizers file ({e}): "
                          "download or save it again") from None
    elif (hf_dir / "vocab.txt").is_file():
        with io_errors("reading", hf_dir / "vocab.txt"):
            lines = (hf_dir / "vocab.txt").read_text(errors="replace").splitlines()
        vocab = {line.strip(): i for i, line in enumerate(lines)}
    return {key: vocab[token] for key, token in tokens.items() if token in vocab}


def check_target(out: Path, overwrite: bool, source: Path) -> None:
    """Refuses, before anything is read or written, an output below a file or not
    writable, one that holds anything (unless `overwrite`), or that is or holds the
    `source` being read."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    require(existing.is_dir(), f"{existing} is a file, not a directory: name a directory "
            "to write into (it is created)")
    require(os.access(existing, os.W_OK | os.X_OK), f"{existing} is not writable (its "
            "permissions): name a directory you may write to")
    source = source.absolute()
    require(not (out == source or out in source.parents),
            f"{out} is, or holds, {source}, which is being read: name another directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    require(overwrite or not held, f"{out} is not empty ({', '.join(held[:4])}"
            f"{', ...' if len(held) > 4 else ''}): name a new directory, or pass "
            "--overwrite to replace everything in it")


def publish(out: Path, write) -> None:
    """`write(directory)` into a new directory beside `out`, which then takes out's place
    (whatever was there is removed: check_target came first). A reader sees the old
    directory or the whole new one, never a mixture; a failed write leaves `out` as it was.
    Modes are those a plain mkdir and open give (umask), for every directory and file
    (safetensors and mkdtemp would give 0600 and 0700)."""
    with io_errors("writing", out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial",
                                        dir=out.parent))
        try:
            write(staging)
            _umask_modes(staging)
            _swap(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already unless it failed


def _swap(staging: Path, out: Path) -> None:
    """Puts `staging` at `out`, removing what was there (put back if that fails)."""
    if not out.exists():
        staging.rename(out)
        return
    aside = staging.with_suffix(".old")
    out.rename(aside)
    try:
        staging.rename(out)
    except OSError:
        aside.rename(out)
        raise
    shutil.rmtree(aside)


# What to do about an I/O failure, by errno (the rest: check the path).
_ADVICE = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space or raise the "
           "disk quota", errno.EFBIG: "raise the file-size limit (ulimit -f) or write "
           "elsewhere", errno.EROFS: "write to a directory on a writable file system",
           errno.EACCES: "use a path you may access, or change its permissions",
           errno.EPERM: "use a path you may access, or change its permissions"}


@contextmanager
def io_errors(action: str, path: Path):
    """An I/O failure inside (an OSError, or safetensors' own error) becomes one HFError
    line naming the path, the system's reason and what to do: the bridge's one place for
    them, reading and writing."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        code = getattr(e, "errno", None)
        found = re.search(r"os error (\d+)", str(e))  # safetensors wraps the OS's error
        code = code or (int(found.group(1)) if found else None)
        if code is None:  # not the system: the file's own bytes
            raise HFError(f"{path}: not a readable safetensors file ({e}): "
                          "download or save it again") from None
        where = getattr(e, "filename", None) or path
        raise HFError(f"{where}: {os.strerror(code).lower()} while {action}: "
                      f"{_ADVICE.get(code, 'check the path')}") from None


def _umask_modes(root: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
