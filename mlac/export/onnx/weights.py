"""The tensors of a one-rank artifact as ONNX initializers in external data.

An initializer here holds no bytes in memory: it names its place (file, offset, length) in OUT_DIR,
which the layout (data.py) gives: inside a hard link of the artifact's own file, or in the one
packed data file that the writer then fills. Memory holds no weights, whatever the model's size;
every initializer is a stored tensor or a dim-0 slice of one (an expert), so no bytes are ever
rewritten. Tensors keep their
stored dtype (bf16, e4m3, float32 scales); the graph casts or dequantizes them to float32:

    bf16 / fp16 weight   Cast(to=float)
    e4m3 weight + scale  DequantizeLinear(w, scale rows, axis=1, block_size=128)

DequantizeLinear blocks one axis, the artifact's scales block two (128x128), so the stored scale
[ceil(N/128), ceil(K/128)] is repeated 128 times along the rows inside the graph (Expand + Reshape
+ Slice, a few kilobytes of work) and DequantizeLinear blocks the columns: the FP8 bytes and the
scales are written exactly as stored, with no requantization.

Like the runtime's `Weights`, every tensor is handed out once and `finish` refuses a tensor the
graph did not use.
"""

from __future__ import annotations

from pathlib import Path

import torch
from onnx import TensorProto

from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.core.fp8 import BLOCK, FP8
from mlac.core.safetensors_io import SafetensorsFile, TensorInfo
from mlac.export.onnx.builder import GraphBuilder
from mlac.export.onnx.data import Layout

ONNX_TYPES = {
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
    torch.float32: TensorProto.FLOAT,
    FP8: TensorProto.FLOAT8E4M3FN,
}
SKIPPED = ("mtp.",)  # the MTP layers (speculative decoding) are not exported


class ArtifactWeights:
    """Rank 0's tensors of the artifact at `root`, handed out by name as graph initializers."""

    def __init__(self, root: Path, manifest: Manifest, g: GraphBuilder, layout: Layout):
        self.g = g
        self.layout = layout
        self._infos: dict[str, tuple[str, TensorInfo]] = {}  # name -> (file relative to root, header)
        self._taken: set[str] = set()
        for rel in sorted({e.file for e in manifest.tensors[0].values()}):
            header = SafetensorsFile(root / rel)
            self._infos.update({n: (rel, info) for n, info in header.tensors.items()})

    def has(self, name: str) -> bool:
        return name in self._infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self._infos[name][1].shape

    def stored(self, name: str, part: int | None = None) -> tuple[str, torch.dtype]:
        """Tensor `name` as stored (or its slice `part` along dim 0): (initializer name, dtype)."""
        if name not in self._infos:
            raise MlacError(f"artifact: tensor {name!r} is missing (the ONNX graph needs it)")
        self._taken.add(name)
        rel, info = self._infos[name]
        shape, start, nbytes = info.shape, info.start, info.nbytes
        if part is not None:
            nbytes //= shape[0]
            shape, start = shape[1:], start + part * nbytes
        init = name if part is None else f"{name}.{part}"
        location, offset = self.layout.place(rel, start, nbytes)
        self.g.initializers.append(_external(init, ONNX_TYPES[info.dtype], shape, location, offset, nbytes))
        return init, info.dtype

    def float32(self, name: str, part: int | None = None) -> str:
        """Tensor `name` (not FP8) as float32."""
        init, dtype = self.stored(name, part)
        return init if dtype == torch.float32 else self.g.op("Cast", init, to=TensorProto.FLOAT)

    def matrix(self, name: str, part: int | None = None) -> tuple[str, bool]:
        """Linear weight `name` [N, K] as float32, and whether it is stored as block FP8."""
        if not self.has(f"{name}.scale"):
            return self.float32(name, part), False
        w, _ = self.stored(name, part)
        scale, _ = self.stored(f"{name}.scale", part)  # [ceil(N/128), ceil(K/128)]
        rows = self._infos[name][1].shape[-2]
        return self.g.op(
            "DequantizeLinear", w, self.scale_rows(scale, name, rows), axis=1, block_size=BLOCK
        ), True

    def scale_rows(self, scale: str, name: str, rows: int) -> str:
        """[nb, kb] block scales -> [rows, kb]: row r takes block row r // 128."""
        nb, kb = self._infos[f"{name}.scale"][1].shape[-2:]
        g = self.g
        s = g.op("Expand", g.op("Unsqueeze", scale, g.ints(1)), g.ints(nb, BLOCK, kb))  # [nb, 128, kb]
        s = g.reshape(s, nb * BLOCK, kb)
        return s if rows == nb * BLOCK else g.slice(s, 0, 0, rows)

    def finish(self) -> None:
        left = sorted(n for n in self._infos.keys() - self._taken if not n.startswith(SKIPPED))
        if left:
            raise MlacError(
                f"artifact: {len(left)} tensor(s) the ONNX graph does not use: {', '.join(left[:5])}"
            )


def _external(
    name: str, elem_type: int, shape: tuple[int, ...], location: str, offset: int, nbytes: int
) -> TensorProto:
    t = TensorProto(name=name, data_type=elem_type, dims=list(shape), data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", nbytes)):
        t.external_data.add(key=key, value=str(value))
    return t
