"""A small ONNX graph builder: `op` appends a node and returns its output name(s).

Names are unique and readable: the current scope (`with g.scope("layers.3.attn")`) plus the op and
a counter. Constants are small initializers held in memory; the weights are added by
weights.py as external-data initializers. Every op is from the default domain (no custom ops).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

OPSET = 21  # DequantizeLinear / QuantizeLinear with block_size and float8 (ONNX 1.16)
IR_VERSION = 10  # the IR of opset 21


class GraphBuilder:
    """Nodes and initializers of one graph, in the order they are added (a topological order)."""

    def __init__(self) -> None:
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._scope: list[str] = []
        self._counter = itertools.count()
        self._consts: dict[tuple, str] = {}

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def fresh(self, what: str) -> str:
        prefix = "/".join(self._scope)
        return f"{prefix}/{what}_{next(self._counter)}" if prefix else f"{what}_{next(self._counter)}"

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        """Append a node of one output; '' in `inputs` marks an omitted optional input."""
        return self.ops(op_type, *inputs, **attrs)[0]

    def ops(self, op_type: str, *inputs: str, outputs: int = 1, **attrs) -> list[str]:
        """Append a node of `outputs` outputs; returns their names."""
        names = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], **attrs))
        return names

    def const(self, value: float | int | Sequence, dtype: type = np.float32) -> str:
        """A small constant initializer (shared between uses of the same value and dtype)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, *values: int) -> str:
        """An int64 vector constant (shapes, axes, indices)."""
        return self.const(list(values), np.int64)

    # ---- shapes -------------------------------------------------------------------------------

    def reshape(self, x: str, *dims: int | str) -> str:
        """Reshape to `dims`: ints are fixed sizes (-1 / 0 as ONNX), strings are int64 [1] tensors."""
        parts = [d if isinstance(d, str) else self.ints(d) for d in dims]
        shape = parts[0] if len(parts) == 1 else self.op("Concat", *parts, axis=0)
        return self.op("Reshape", x, shape)

    def dim(self, x: str, axis: int) -> str:
        """The size of `x` along `axis`, as an int64 [1] tensor."""
        return self.op("Shape", x, start=axis, end=axis + 1)

    def slice(self, x: str, axis: int, start: int | str, end: int | str) -> str:
        s = start if isinstance(start, str) else self.ints(start)
        e = end if isinstance(end, str) else self.ints(end)
        return self.op("Slice", x, s, e, self.ints(axis))

    def split(self, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
        return self.ops("Split", x, self.ints(*sizes), outputs=len(sizes), axis=axis)


def value_info(name: str, elem_type: int, shape: Sequence[int | str]) -> object:
    """A graph input/output: ints are fixed sizes, strings named dynamic dimensions."""
    return helper.make_tensor_value_info(name, elem_type, list(shape))


__all__ = ["GraphBuilder", "IR_VERSION", "OPSET", "TensorProto", "value_info"]
