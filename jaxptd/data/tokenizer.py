"""Document bytes -> token ids: the built-in byte tokenizer and Hugging Face tokenizers files.

Invariants:

- Byte tokenizer: ids 0..255 are bytes, 256 is end-of-document (eot), vocab 257, lossless;
  it needs no package.
- A ``tokenizers`` JSON file (the optional package ``tokenizers`` >= 0.15.1) encodes each
  document as plain UTF-8 text, and only that: a document that is not UTF-8 is refused
  rather than altered; no post-processor tokens (BOS, CLS, SEP), truncation or padding,
  whatever the file configures; special tokens written in the text (``<|endoftext|>`` in a
  document about tokenizers) are split like any text, so an eot the file marks special,
  as files do, only ever appears where preparation appends it, after each document. eot
  is the first of ``_EOT_TOKENS`` the file defines.
- ``vocab_size`` is one more than the largest id (a file's ids may have gaps, so the
  library's token count can be smaller), and ``dtype`` holds every id: uint16 while
  vocab_size <= 2**16, else uint32.
- A long document is encoded in pieces of at least ``_PIECE_CHARS`` characters, so memory
  stays bounded: one ``encode`` keeps ~300 bytes per token (1.2 GB for 6.7 MB of text).
  A piece may end before a lone space between non-space characters or after a newline
  between them, where pre-tokenizers split anyway, and does only if encoding
  ``_CHECK_CHARS`` characters either side of the cut gives the same ids cut and whole
  (metaspace tokenizers refuse newline cuts and accept space cuts). After
  ``_REFUSED_CUTS`` refusals in a row (a normalizer that prepends to the text, as
  Llama-2's does, refuses every cut) the rest of the document is one piece. The ids thus
  equal those of the whole document for any tokenizer whose pre-tokenization is local
  (regex, byte-level, whitespace, metaspace).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxptd.data.errors import DataError

BYTE_VOCAB_SIZE = 257
BYTE_EOT_ID = 256
# Special tokens tried, in order, as the end-of-document id of a Hugging Face tokenizer.
_EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_PIECE_CHARS = 1 << 18
_CHECK_CHARS = 256
_REFUSED_CUTS = 16
_CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")  # x| y or x\n|y


class Tokenizer:
    """Document bytes -> token ids. Byte-level unless built by ``load_tokenizer``.

    Attributes:
      name: "byte" or the tokenizer file's absolute path (stored in meta.json).
      vocab_size: one more than the largest id; eot_id: the end-of-document id.
    """

    def __init__(self, name: str = "byte", vocab_size: int = BYTE_VOCAB_SIZE,
                 eot_id: int = BYTE_EOT_ID, hf_tokenizer=None):
        self.name, self.vocab_size, self.eot_id = name, vocab_size, eot_id
        self._hf = hf_tokenizer

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of one document (no eot), shape [n], dtype ``self.dtype``.

        Raises:
          UnicodeDecodeError: a tokenizers file is used and ``data`` is not UTF-8.
        """
        if self._hf is None:
            return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)
        text = data.decode("utf-8")
        return np.concatenate([np.asarray(self._ids(piece), dtype=self.dtype)
                               for piece in self._pieces(text)])

    def decode(self, ids) -> str:
        """Text of token ids (eot and ids outside the vocabulary dropped; bytes that are not
        UTF-8 replaced)."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) != self.eot_id]
        if self._hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)

    def _ids(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def _pieces(self, text: str):
        """Yields ``text`` in consecutive pieces that encode as the whole does (see the
        module docstring)."""
        begin, search_from, refused = 0, _PIECE_CHARS, 0
        while len(text) - begin > _PIECE_CHARS and refused < _REFUSED_CUTS:
            cut = _CUT.search(text, search_from)
            if cut is None:
                break
            if self._cut_is_invisible(text, cut.start()):
                yield text[begin:cut.start()]
                begin, refused = cut.start(), 0
                search_from = begin + _PIECE_CHARS
            else:
                refused += 1
                search_from = cut.start() + 1
        yield text[begin:]

    def _cut_is_invisible(self, text: str, at: int) -> bool:
        left, right = text[max(0, at - _CHECK_CHARS):at], text[at:at + _CHECK_CHARS]
        return self._ids(left + right) == self._ids(left) + self._ids(right)


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The byte tokenizer for None or "byte", else a Hugging Face tokenizers JSON file.

    Raises:
      DataError: the file is missing or not a tokenizers file, the package is missing or
        too old, or the file defines none of the end-of-document tokens.
    """
    if spec is None or spec == "byte":
        return Tokenizer()
    if not Path(spec).is_file():
        raise DataError(f"--tokenizer {spec!r} does not exist; expected a Hugging Face "
                        "tokenizers JSON file or 'byte'")
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"--tokenizer {spec!r} needs the Python package 'tokenizers' "
                        "(pip install tokenizers); omit it for the byte tokenizer") from None
    try:
        hf = tokenizers.Tokenizer.from_file(spec)
    except Exception as err:  # the Rust side raises plain Exception
        reason = " ".join(str(err).split())
        raise DataError(f"--tokenizer {spec!r} is not a tokenizers JSON file ({reason}); "
                        "expected a tokenizer.json as saved by Tokenizer.save") from None
    if not hasattr(hf, "encode_special_tokens"):
        raise DataError(f"--tokenizer {spec!r} needs tokenizers >= 0.15.1, found "
                        f"{tokenizers.__version__} (pip install -U tokenizers)")
    hf.no_truncation()
    hf.no_padding()
    hf.encode_special_tokens = True
    eot_ids = [hf.token_to_id(token) for token in _EOT_TOKENS]
    eot_ids = [token_id for token_id in eot_ids if token_id is not None]
    if not eot_ids:
        raise DataError(f"--tokenizer {spec!r} has none of the end-of-document tokens "
                        f"{list(_EOT_TOKENS)}")
    vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(str(Path(spec).resolve()), vocab_size, eot_ids[0], hf)
