"""Token data for jaxptd: preparing text into token files and reading deterministic batches.

- ``corpus.py``: ``prepare_corpus`` (text -> token directory, atomically), the built-in
  ``pystdlib`` corpus and ``resolve_corpus``, and the command ``python -m
  jaxptd.data.prepare`` (``prepare.py``: its entry alone).
- ``documents.py``: which input files are documents, and each document's split key and
  text (a file, or a JSON Lines line).
- ``tokenizer.py``: document bytes -> token ids, byte-level or a Hugging Face
  ``tokenizers`` JSON file (the optional package ``tokenizers``).
- ``dataset.py``: ``TokenDataset`` (memmapped split; ``batch(seed, step, ...)`` is a pure
  function of its arguments, rows selectable per process), ``unigram_entropy``.
- ``megatron.py``: Megatron-LM indexed datasets (``.bin``/``.idx``) read as splits and
  written (``--format megatron``).
- ``splits.py``: the split names and the val-by-tokens rule both formats share.
- ``errors.py``: ``DataError``.

Pure numpy; nothing here imports JAX. User-caused problems raise ``DataError``
(a ValueError) with a one-line message for the entry point to print as ``error:``.
"""
from jaxptd.data.corpus import prepare_corpus, resolve_corpus
from jaxptd.data.dataset import TokenDataset, read_meta, unigram_entropy
from jaxptd.data.errors import DataError

__all__ = ["DataError", "TokenDataset", "prepare_corpus", "read_meta", "resolve_corpus",
           "unigram_entropy"]
