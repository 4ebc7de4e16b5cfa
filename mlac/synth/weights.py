"""The tensors of a DeepSeek checkpoint, and how to draw each one at random.

`checkpoint_params` lists every weight an official Hugging Face checkpoint of the config holds,
with its HF name and shape: the reader's table (`mlac.core.names.expected_layer`), plus the
MTP layers' own tensors, which the reader sets aside unchecked. `draw_chunk` draws a block of rows of one of them and encodes it as
stored (bf16, or FP8 e4m3 plus float32 `weight_scale_inv` blocks). Each chunk has its own
generator, seeded from (seed, tensor name, chunk index), so the bytes do not depend on the order
or the threads that produce them. A draw is 16 random bits looked up in a table of normal
quantiles (2-3x cheaper than torch.randn, indistinguishable from it at bf16 precision).

Scales keep a forward pass sane through any depth: linear weights ~ N(0, 1/in_features) (unit
gain), RMSNorm weights ~ 1 + N(0, 0.05^2), embeddings ~ N(0, 1), router weights ~ N(0, 1/D) so
that expert scores are spread out, a small N(0, 0.01^2) routing correction bias, and an LM head
of gain HEAD_GAIN: logits of std ~3, peaked enough that greedy top-1 is not a near tie.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from mlac.core.config import ModelConfig
from mlac.core.fp8 import BLOCK, quantize_blocks, scale_shape
from mlac.core.names import Expected, expected_globals, expected_layer

Init = Literal["linear", "head", "norm", "embed", "router", "bias"]

HEAD_GAIN = 3.0
_LEVELS = 1 << 16  # distinct values a draw can take
_TAKE_STEP = 1 << 16  # table lookups per np.take call
CHUNK_ELEMS = 1 << 22  # elements drawn per generator call: bounds memory, sets the seeding grain
SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Param:
    """One weight of the checkpoint, as the official release stores it."""

    name: str
    shape: tuple[int, ...]
    init: Init
    dtype: torch.dtype  # stored dtype of the weight itself
    stream: str  # random stream: the name, or the tensor it copies (MTP embed / head)

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def scale_name(self) -> str:
        return self.name + SCALE_SUFFIX

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return scale_shape(self.shape)

    def stored(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor written for this weight: itself, then its scale."""
        out = [(self.name, self.dtype, self.shape)]
        if self.fp8:
            out.append((self.scale_name, torch.float32, self.scale_shape))
        return out

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.stored())

    def chunk_rows(self) -> int:
        """Rows per chunk: whole rows, and whole FP8 block rows for FP8 weights."""
        cols = math.prod(self.shape[1:])
        rows = max(1, CHUNK_ELEMS // max(cols, 1))
        if self.fp8:
            rows = max(BLOCK, rows // BLOCK * BLOCK)
        return min(rows, self.shape[0])

    def chunks(self) -> list[tuple[int, int]]:
        """[start, stop) row ranges, in order."""
        step = self.chunk_rows()
        return [(r, min(r + step, self.shape[0])) for r in range(0, self.shape[0], step)]


# ---------------------------------------------------------------------------------------------
# The official tensor list


def checkpoint_params(cfg: ModelConfig) -> list[Param]:
    """Every weight of the HF checkpoint: embed, layers, norm, lm_head, then the MTP layers."""
    dense = _DTYPES[cfg.torch_dtype]
    linear = torch.float8_e4m3fn if cfg.quantization is not None else dense
    top = {name: _param(name, exp, dense, linear) for name, exp in expected_globals(cfg).items()}
    params = [top.pop("model.embed_tokens.weight")]
    for i in range(cfg.num_hidden_layers):
        params += _layer(cfg, i, dense, linear)
    params += [top.pop("model.norm.weight"), top.pop("lm_head.weight")]
    assert not top, f"unplaced global tensors {sorted(top)}"
    for k in range(cfg.num_nextn_predict_layers):
        params += _mtp_layer(cfg, cfg.num_hidden_layers + k, dense, linear)
    return params


def _p(name: str, shape: tuple[int, ...], init: Init, dtype: torch.dtype) -> Param:
    return Param(name, shape, init, dtype, name)


def _layer(cfg: ModelConfig, i: int, dense: torch.dtype, linear: torch.dtype) -> list[Param]:
    """Decoder layer i, in the reader's table order."""
    pre = f"model.layers.{i}."
    return [_param(pre + suffix, exp, dense, linear) for suffix, exp in expected_layer(cfg, i).items()]


def _param(name: str, exp: Expected, dense: torch.dtype, linear: torch.dtype) -> Param:
    """A tensor of the reader's table, with its init and stored dtype (FP8 where it may be)."""
    init: Init
    if name.endswith("e_score_correction_bias"):
        return _p(name, exp.shape, "bias", torch.float32)
    if name == "model.embed_tokens.weight":
        init = "embed"
    elif name == "lm_head.weight":
        init = "head"
    elif name.endswith("mlp.gate.weight"):
        init = "router"
    elif len(exp.shape) == 1:
        init = "norm"
    else:
        init = "linear"
    return _p(name, exp.shape, init, linear if exp.fp8 else dense)


def _mtp_layer(cfg: ModelConfig, n: int, dense: torch.dtype, linear: torch.dtype) -> list[Param]:
    """A V3 MTP module: a full decoder layer plus its own norms, projection, embed and head.

    As released, its embed_tokens and shared_head.head are copies of the main model's: they draw
    from the same random streams, so they are byte-identical here too.
    """
    D, V = cfg.hidden_size, cfg.vocab_size
    pre = f"model.layers.{n}"
    return [
        Param(f"{pre}.embed_tokens.weight", (V, D), "embed", dense, "model.embed_tokens.weight"),
        _p(f"{pre}.enorm.weight", (D,), "norm", dense),
        _p(f"{pre}.hnorm.weight", (D,), "norm", dense),
        _p(f"{pre}.eh_proj.weight", (D, 2 * D), "linear", linear),
        *_layer(cfg, n, dense, linear),
        _p(f"{pre}.shared_head.norm.weight", (D,), "norm", dense),
        Param(f"{pre}.shared_head.head.weight", (V, D), "head", dense, "lm_head.weight"),
    ]


# ---------------------------------------------------------------------------------------------
# Drawing


def chunk_seed(seed: int, stream: str, chunk: int) -> int:
    """A stable 64-bit seed for one chunk of one tensor (not Python's salted hash())."""
    digest = hashlib.blake2b(f"{seed}\0{stream}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.cache
def _normal_quantiles() -> torch.Tensor:
    """The 65536 quantiles (i + 1/2) / 65536 of N(0, 1): a table that turns 16 random bits into
    a normal draw, finer than bf16 resolution, truncated at +-4.3 sigma."""
    p = (torch.arange(_LEVELS, dtype=torch.float64) + 0.5) / _LEVELS
    return torch.special.ndtri(p)


@functools.lru_cache(maxsize=64)
def _table(init: Init, fan_in: int, dtype: torch.dtype) -> np.ndarray:
    """The quantile table mapped to this init's distribution, as raw `dtype` bits."""
    z = _normal_quantiles()
    if init in ("linear", "router"):
        v = z * fan_in**-0.5
    elif init == "head":
        v = z * (HEAD_GAIN * fan_in**-0.5)
    elif init == "norm":
        v = 1.0 + 0.05 * z
    elif init == "bias":
        v = 0.01 * z
    else:  # embed
        v = z
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    return v.to(dtype).view(bits).numpy()


def draw_values(param: Param, seed: int, chunk: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """One chunk of random values in `dtype` (bf16/fp16/fp32): [rows, *shape[1:]]."""
    n = rows * math.prod(param.shape[1:])
    bits = np.random.SFC64(chunk_seed(seed, param.stream, chunk)).random_raw(-(-n // 4))
    idx = bits.view(np.uint16)[:n]  # 4 draws per 64 random bits
    table = _table(param.init, param.shape[-1], dtype)
    out = np.empty(n, table.dtype)
    for s in range(0, n, _TAKE_STEP):  # np.take widens indices to int64: keep that copy in cache
        np.take(table, idx[s : s + _TAKE_STEP], out=out[s : s + _TAKE_STEP])
    return torch.from_numpy(out).view(dtype).view(rows, *param.shape[1:])


def draw_chunk(param: Param, seed: int, chunk: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk as stored: (weight rows in the stored dtype, their scale rows or None).

    An FP8 chunk (whole 128-row blocks but for the last) is block-quantized as DeepSeek-V3
    releases are: `weight_scale_inv` multiplies, each block's largest magnitude maps to 448.
    """
    if param.fp8:
        return quantize_blocks(draw_values(param, seed, chunk, rows, torch.float32))
    return draw_values(param, seed, chunk, rows, param.dtype), None
