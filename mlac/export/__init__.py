"""Export of a compiled artifact to other formats: ONNX (`mlac export onnx`, see docs/onnx.md).

onnx/builder.py   a small graph builder over onnx.helper: nodes, constants, unique names
onnx/weights.py   the artifact's tensors as ONNX initializers in external data (no copy in memory)
onnx/data.py      where their bytes go: one packed data file, or the artifact's files hard-linked
onnx/layers.py    linear (bf16 / block-FP8 with DequantizeLinear), RMSNorm, rope, MLA attention
onnx/moe.py       routing (TopK, GatherElements, ScatterElements) and the routed experts
onnx/graph.py     the model graph: inputs, layers, outputs, and the feeding spec (io JSON)
onnx/writer.py    the atomic OUT_DIR: data file, graph, JSON, tokenizer, checker
"""
