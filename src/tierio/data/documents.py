"""What the input readers (builder's JSONL/npy/text, parquet's columns) share: a batch of documents
and the tokenizer loader; its own module so that builder and parquet need not import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierio.errors import ConfigError, FormatError, NotFoundError


@dataclass(frozen=True)
class DocumentBatch:
    """Many documents at once: ``tokens`` concatenated, ``lengths`` the token count of each;
    ``locate(i)`` says where document ``i`` of the batch came from (for error messages)."""

    tokens: np.ndarray
    lengths: np.ndarray
    locate: Callable[[int], str]

    def document_of(self, token_index: int) -> int:
        """The document of the batch that holds token ``token_index``."""
        return int(np.searchsorted(np.cumsum(self.lengths), token_index, side="right"))


def load_tokenizer(tokenizer_json: str | Path):
    """A Hugging Face ``tokenizers`` tokenizer from a local tokenizer.json (no network)."""
    try:
        from tokenizers import Tokenizer  # optional dependency
    except ImportError:
        raise ConfigError(
            "raw text input needs the 'tokenizers' package, which is not installed: "
            "pip install tokenizers, or tokenize elsewhere and pass JSONL of token ids or .npy"
        ) from None
    p = Path(tokenizer_json)
    if not p.is_file():
        raise NotFoundError(f"tokenizer file {p} does not exist; pass the path of a local tokenizer.json")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the Rust binding raises its own exception type
        raise FormatError(f"{p}: cannot load tokenizer ({exc})") from None
