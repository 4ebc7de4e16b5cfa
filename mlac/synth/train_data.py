"""Training data for a small trained checkpoint: the Python standard library's own `.py` files.

Every machine with Python has this corpus. Files are taken in sorted order (site-packages and the
`test`/`tests` packages left out), and every HOLD_OUT_EVERY-th file is held out for evaluation, so
the split is the same on every run of the same Python. A byte-level BPE (DeepSeek's special tokens
first, as `mlac.synth.tokenizer` has them) is trained on the train split only. Documents are
joined as `bos text eos`; training windows are drawn from one seeded generator.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mlac.core.errors import MlacError
from mlac.synth.tokenizer import EOS

HOLD_OUT_EVERY = 20  # file k is held out when k % 20 == 19
_SKIP_PARTS = {"site-packages", "test", "tests"}


def stdlib_files() -> list[Path]:
    """The stdlib's .py files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (f for f in root.rglob("*.py") if not _SKIP_PARTS & set(f.relative_to(root).parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if not files:
        raise MlacError(f"{root}: no .py files found (is the Python standard library installed?)")
    return files


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every HOLD_OUT_EVERY-th file is held out."""
    held = [f for k, f in enumerate(files) if k % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [f for k, f in enumerate(files) if k % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return train, held


def read_texts(files: list[Path], max_bytes: int | None) -> list[str]:
    """File texts in order, stopping before max_bytes (None: all); undecodable bytes replaced."""
    texts: list[str] = []
    total = 0
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if max_bytes is not None and total + len(text) > max_bytes and texts:
            break
        texts.append(text)
        total += len(text)
    return texts


def encode(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """The documents as one int64 stream [N]: bos doc eos, bos doc eos, ..."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):  # the post-processor adds bos
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq + 2] windows at random offsets from one seeded generator.

    seq + 2 tokens: inputs are [:, :seq]; the main head predicts [:, 1:seq+1], MTP [:, 2:seq+2].
    """
    if stream.numel() < seq + 3:
        raise MlacError(f"corpus of {stream.numel()} tokens is shorter than one window of {seq + 2}")
    g = torch.Generator().manual_seed(seed)
    span = torch.arange(seq + 2)
    while True:
        starts = torch.randint(0, stream.numel() - seq - 2, (batch,), generator=g)
        yield stream[starts[:, None] + span]  # [B, seq + 2]


def eval_windows(stream: torch.Tensor, seq: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping [n, seq + 1] windows from the start of `stream` (n <= max_windows)."""
    n = min(max_windows, (stream.numel() - 1) // seq)
    if n < 1:
        raise MlacError(f"held-out split of {stream.numel()} tokens is shorter than one window of {seq + 1}")
    return torch.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)])


def unigram_perplexity(train: torch.Tensor, held: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of `held` under train-split unigram frequencies with add-one smoothing."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[held].mean().item())
