"""Streaming safetensors I/O with errors that name the file and tensor.

The reader parses the header itself and reads one tensor at a time with plain file reads (no
mmap), so the compiler's memory holds only the tensors it is working on and a truncated or
corrupt file is reported before any data is used. The writer computes the header up front and
streams each tensor's bytes in chunks, hashing them as they go (whole and per piece: hashing.py).

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw little-endian data. Offsets are relative to the end of the header.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from mlac.core.errors import MlacError
from mlac.core.hashing import PIECE_SIZE, FileHashes, PieceHash
from mlac.core.jsonio import load_json

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20
DATA_ALIGN = 64  # bytes: where the data section and (by aligned_order) most tensors start
QUEUE_CHUNKS = 4  # chunks (each <= 64 MiB, see iter_rows) waiting to be hashed and written


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """The header of one safetensors file, validated against the file's size.

    As the format requires (and the `safetensors` library checks): unique names, each tensor's
    byte length = prod(shape) * itemsize, and the tensors, sorted by offset, tile the data
    exactly: the first begins at 0, each begins where the previous one ends, the last ends at
    the end of the file. Two names on the same bytes, overlaps, gaps and trailing bytes are refused.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors = self._parse()

    def _fail(self, what: str) -> MlacError:
        return MlacError(f"{self.path}: {what}")

    def _parse(self) -> dict[str, TensorInfo]:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb", buffering=0) as f:
                head = read_exact(f, 0, 8)
                if len(head) < 8:
                    raise self._fail("truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or n + 8 > size:
                    raise self._fail("corrupt or truncated safetensors header")
                raw = read_exact(f, 8, n)
        except OSError as e:
            raise self._fail(f"cannot read ({e.strerror})") from None
        header = load_json(raw, f"{self.path}: corrupt safetensors header", object_pairs_hook=self._unique)
        header.pop("__metadata__", None)
        data_start = 8 + n
        out = {name: self._entry(name, meta, data_start) for name, meta in header.items()}
        self._check_tiling(out, data_start, size - data_start)
        return out

    def _unique(self, pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:
                raise self._fail(f"corrupt safetensors header: name {key!r} appears twice")
            out[key] = value
        return out

    def _entry(self, name: str, meta: object, data_start: int) -> TensorInfo:
        try:
            assert isinstance(meta, dict)
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(_index(d) for d in meta["shape"])
            begin, end = (_index(x) for x in meta["data_offsets"])
        except (AssertionError, KeyError, TypeError, ValueError):
            raise self._fail(f"corrupt header entry for tensor {name!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise self._fail(f"tensor {name!r}: header offsets do not match its shape and dtype")
        return TensorInfo(name, dtype, shape, data_start + begin, nbytes)

    def _check_tiling(self, tensors: dict[str, TensorInfo], data_start: int, data_len: int) -> None:
        """The tensors, sorted by where they begin, cover [0, data_len) exactly once."""
        at = 0  # relative to data_start: where the next tensor must begin
        for info in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
            begin = info.start - data_start
            if begin != at:
                what = "overlaps the previous tensor" if begin < at else f"leaves a gap of {begin - at} bytes"
                raise self._fail(
                    f"corrupt safetensors header: tensor {info.name!r} {what} (begins at {begin})"
                )
            at = begin + info.nbytes
            if at > data_len:
                raise self._fail(
                    f"truncated: tensor {info.name!r} ends at byte {at} but the data is {data_len} bytes"
                )
        if at != data_len:
            raise self._fail(f"corrupt safetensors file: {data_len - at} bytes after the last tensor's data")

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        try:
            with open(self.path, "rb", buffering=0) as f:
                got = readinto_exact(f, info.start, memoryview(buf.numpy()))
        except OSError as e:
            raise self._fail(f"cannot read tensor {name!r} ({e.strerror})") from None
        if got != info.nbytes:
            raise self._fail(f"truncated while reading tensor {name!r}")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return buf.view(info.dtype).view(info.shape)


def _index(value: object) -> int:
    """A shape dimension or offset: a non-negative JSON integer (not a bool, float or string)."""
    if type(value) is not int or value < 0:
        raise ValueError(value)
    return value


def readinto_exact(f: BinaryIO, offset: int, buf: memoryview) -> int:
    """Fill `buf` from byte `offset` of the unbuffered file `f`; return the bytes read (less than
    len(buf) only at end of file). One read returns at most 2,147,479,552 bytes on Linux (and
    may return less anywhere), so this loops until the buffer is full."""
    f.seek(offset)
    done = 0
    while done < len(buf):
        got = f.readinto(buf[done:])
        if not got:
            break
        done += got
    return done


def read_exact(f: BinaryIO, offset: int, n: int) -> bytes:
    """`n` bytes from `offset` of the unbuffered file `f` (fewer only at end of file)."""
    buf = bytearray(n)
    got = readinto_exact(f, offset, memoryview(buf))
    return bytes(buf[:got])


def _bytes_view(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class WriteSpec:
    """One tensor to write: its header entry and the chunks whose bytes concatenate to it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Iterable[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def encode_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """(name, dtype, shape) of each tensor, in file order -> (the file's first bytes: the 8-byte
    length and the JSON header, padded with spaces so that data starts DATA_ALIGN-byte aligned;
    each tensor's data offset, relative to the end of those bytes)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offsets.append(offset)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


def aligned_order(specs: list[WriteSpec]) -> list[str]:
    """File order of the tensors: those whose size is a multiple of DATA_ALIGN first, then the
    rest, each by name. Every tensor of the first group then starts DATA_ALIGN-aligned, so that
    the loader can hand it out as a view of the file's device copy (the kernels' vector loads
    need 16-byte aligned rows: a view at an unaligned offset runs them several times slower)."""
    return [x.name for x in sorted(specs, key=lambda x: (_nbytes(x) % DATA_ALIGN != 0, x.name))]


def _nbytes(spec: WriteSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


class _Sink:
    """A thread that calls `take` on each chunk put in its queue, in order (at most QUEUE_CHUNKS
    wait); after its first error it drops the rest and keeps the error for its owner."""

    def __init__(self, take: Callable[[memoryview], object]):
        self.take = take
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while (data := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.take(data)
                except BaseException as e:  # noqa: BLE001 - re-raised by _Out
                    self.error = e

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class _Out:
    """A file written and hashed on background threads, so that they overlap the producer's work
    (hashlib and file writes release the GIL): one writes the bytes and hashes them whole, one
    hashes them per piece of `piece` bytes (hashing.py). Each chunk is read from memory, not disk."""

    def __init__(self, path: Path, piece: int):
        self.f = open(path, "wb")
        self.whole, self.parts = hashlib.sha256(), PieceHash(piece)
        self.size = 0
        self.sinks = [_Sink(self._write), _Sink(self.parts.update)]

    def _write(self, data: memoryview) -> None:
        self.f.write(data)
        self.whole.update(data)

    def _error(self) -> BaseException | None:
        return next((s.error for s in self.sinks if s.error is not None), None)

    def write(self, data: memoryview) -> int:
        if (error := self._error()) is not None:
            raise error
        for sink in self.sinks:
            sink.queue.put(data)  # the memoryview keeps its tensor alive until both sinks took it
        self.size += len(data)
        return len(data)

    def close(self) -> MlacError | None:
        """End the threads and close the file; the first error of any, as a one-line MlacError."""
        for sink in self.sinks:
            sink.close()
        error = self._error()
        try:
            self.f.close()  # NOTE: flushes the last buffered bytes, so it may fail too (disk full)
        except OSError as e:
            error = error or e
        return None if error is None else MlacError(f"{self.f.name}: write failed ({error})")

    def hashes(self) -> FileHashes:
        """The written file's hashes (after close)."""
        assert self.parts.size == self.size, (self.f.name, self.parts.size, self.size)
        return FileHashes(self.size, self.whole.hexdigest(), self.parts.piece, self.parts.pieces())


def write_safetensors_lockstep(
    paths: list[Path], specs: list[list[WriteSpec]], piece: int = PIECE_SIZE
) -> list[FileHashes]:
    """Write several files with the same tensor names (one per rank), tensor by tensor; return
    each file's hashes (its size, sha256, and sha256 per `piece` bytes), computed as it was written.

    The ranks' chunks of one tensor are written in turn, so that slices of one source tensor
    are produced while it is still in the reader's cache: each source tensor is read once.
    """
    names = aligned_order(specs[0])  # one order for every rank: the shards of a tensor have one size
    position = {name: i for i, name in enumerate(names)}
    specs = [sorted(s, key=lambda x: position[x.name]) for s in specs]
    assert all([x.name for x in s] == names for s in specs), "ranks must hold the same tensor names"
    outs = [_Out(p, piece) for p in paths]
    try:
        for out, s in zip(outs, specs, strict=True):
            out.write(memoryview(encode_header([(x.name, x.dtype, x.shape) for x in s])[0]))
        for i in range(len(names)):
            _write_tensor_lockstep(outs, [s[i] for s in specs])
    finally:
        failed = [
            e for out in outs if (e := out.close()) is not None
        ]  # every file closed, every thread ended
    if failed:
        raise failed[0]
    return [out.hashes() for out in outs]


def _write_tensor_lockstep(outs: list[_Out], specs: list[WriteSpec]) -> None:
    iters = [iter(s.chunks) for s in specs]
    written = [0] * len(specs)
    live = set(range(len(specs)))
    while live:
        for r in sorted(live):
            chunk = next(iters[r], None)
            if chunk is None:
                live.discard(r)
                continue
            if chunk.dtype != specs[r].dtype:
                raise AssertionError(f"{specs[r].name}: chunk dtype {chunk.dtype} != {specs[r].dtype}")
            written[r] += outs[r].write(_bytes_view(chunk))
    for s, n in zip(specs, written, strict=True):
        if n != s.nbytes:
            raise AssertionError(f"{s.name}: wrote {n} bytes, expected {s.nbytes}")


def iter_rows(t: torch.Tensor, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
    """Split a tensor along dim 0 into pieces of at most ~max_bytes (for streaming writes)."""
    if t.dim() == 0 or t.nbytes <= max_bytes:
        yield t
        return
    rows = max(1, max_bytes // max(1, t[0].nbytes))
    yield from t.split(rows)
