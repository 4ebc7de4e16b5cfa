"""shard: split one layer's tensors into per-rank slices for tensor and expert parallelism.

    --tp N: attention by heads (wq/wq_b rows, w_kc/w_vc heads, wo columns); dense MLP and
            shared experts column-parallel w13 (gate and up halves each split) and row-parallel
            w2; embed and head vocab-parallel (rows); latent projections, norms and router
            replicated.
    --ep 1: every routed expert sliced across the N ranks like the dense MLP.
    --ep N: each rank holds E/N whole experts (rank r: experts [r·E/N, (r+1)·E/N)).
    --dp-attention: attention weights (wq/wq_b, w_kc, w_vc, wo) of the decoder layers whole on
            every rank: each rank runs every head for its own requests (runtime/dp_attention.py);
            the rest as above (MTP layers too: speculative decoding is not run under DP attention).

Each rank's slice holds only its part: the N slices of a tensor add up to the 1-rank tensor.
FP8 block scales are sliced with their weights when the cut falls on a 128 boundary; where it
does not (a source FP8 block would be cut), the slice is dequantized and the fp8 pass, which
runs after this one, quantizes it again with blocks of its own. Every divisibility condition
is checked by `check` before any tensor is read.
"""

from __future__ import annotations

from mlac.core.artifact import CompileOptions
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import BLOCK, dequantize_lazy
from mlac.core.lazy import LazyTensor, concat_rows, per_part, take_cols, take_rows
from mlac.passes import PassContext

NAME = "shard"
Range = tuple[int, int]


def params(ctx: PassContext) -> dict:
    o = ctx.options
    return {"tp": o.tp, "ep": o.ep, "attention": "replicated" if o.dp_attention else "heads",
            "mlp": "column/row", "vocab": "rows", "experts": "whole" if o.ep > 1 else "sliced"}  # fmt: skip


def check(cfg: ModelConfig, o: CompileOptions) -> None:
    """Refuse a plan that does not divide the model, naming the dimension and the value."""
    n = o.tp
    if n < 1:
        raise MlacError(f"--tp {n}: must be at least 1")
    if o.ep not in (1, n):
        raise MlacError(
            f"--ep {o.ep}: must be 1 (experts sliced across ranks) or equal to --tp {n} (whole experts)"
        )
    if o.dp_attention and n < 2:
        raise MlacError(
            f"--dp-attention needs --tp 2 or more (got --tp {n}): it splits requests over the ranks"
        )
    dims = {} if o.dp_attention else {"num_attention_heads": cfg.num_attention_heads}  # DP: heads whole
    dims["vocab_size"] = cfg.vocab_size
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dims["intermediate_size"] = cfg.intermediate_size
    if cfg.n_routed_experts is not None:
        dims["n_routed_experts" if o.ep > 1 else "moe_intermediate_size"] = (
            cfg.n_routed_experts if o.ep > 1 else cfg.moe_intermediate_size
        )
        if cfg.n_shared_experts:
            dims["moe_intermediate_size*n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    for name, value in dims.items():
        if value % n:
            hint = (
                " (the vocabulary would need padding, which mlac does not do)" if name == "vocab_size" else ""
            )
            raise MlacError(f"--tp {n} does not divide {name}={value}{hint}")


def run_global(tensors: dict[str, LazyTensor], ctx: PassContext) -> list[dict[str, LazyTensor]]:
    n, out = ctx.options.tp, []
    for r in range(n):
        rank = {}
        for name, t in tensors.items():
            vocab = name in ("embed", "head") or name.endswith((".embed", ".head"))  # + MTP's own copies
            rank[name] = _rows(t, r, n) if vocab else t
        out.append(rank)
    return out


def run(tensors: dict[str, LazyTensor], ctx: PassContext) -> list[dict[str, LazyTensor]]:
    """One layer's tensors -> one dict per rank."""
    if ctx.layer is None:
        return run_global(tensors, ctx)
    cfg, n = ctx.config, ctx.options.tp
    if n == 1:
        return [tensors]
    h_local = cfg.num_attention_heads // n  # (unused with dp_attention, which need not divide H)
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    ranks: list[dict[str, LazyTensor]] = [{} for _ in range(n)]
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name + ".scale")
        suffix = name.split(".", 2)[2]  # drop "layers.{i}."
        for r in range(n):
            heads = (r * h_local, (r + 1) * h_local)
            if suffix.startswith("attn.") and name.startswith("layers.") and ctx.options.dp_attention:
                w, s = t, scale
            elif suffix in ("attn.wq", "attn.wq_b"):
                w, s = _slice(t, scale, rows=[(heads[0] * qk, heads[1] * qk)])
            elif suffix in ("attn.w_kc", "attn.w_vc"):
                w, s = take_rows(t, *heads), None
            elif suffix == "attn.wo":
                w, s = _slice(t, scale, cols=(heads[0] * v, heads[1] * v))
            elif suffix in ("mlp.w13", "moe.shared.w13") or (suffix == "moe.w13" and ctx.options.ep == 1):
                w, s = _slice(t, scale, rows=_gate_up_rows(t.shape[-2] // 2, r, n))
            elif suffix in ("mlp.w2", "moe.shared.w2") or (suffix == "moe.w2" and ctx.options.ep == 1):
                w, s = _slice(t, scale, cols=_even(t.shape[-1], r, n))
            elif suffix in ("moe.w13", "moe.w2"):  # ep == tp: whole experts
                w, s = _slice(t, scale, experts=_even(t.shape[0], r, n))
            else:  # latent projections, norms, router: replicated
                w, s = t, scale
            ranks[r][name] = w
            if s is not None:
                ranks[r][name + ".scale"] = s
    return ranks


def _even(size: int, r: int, n: int) -> Range:
    k = size // n
    return r * k, (r + 1) * k


def _gate_up_rows(inter: int, r: int, n: int) -> list[Range]:
    a, b = _even(inter, r, n)
    return [(a, b), (inter + a, inter + b)]


def _rows(t: LazyTensor, r: int, n: int) -> LazyTensor:
    return take_rows(t, *_even(t.shape[0], r, n))


def _slice(
    t: LazyTensor, scale: LazyTensor | None, rows: list[Range] | None = None, cols: Range | None = None,
    experts: Range | None = None,
) -> tuple[LazyTensor, LazyTensor | None]:  # fmt: skip
    """Slice a 2-D weight or a stack of them (rows/cols inside each matrix, or whole experts)."""
    if scale is not None and not _aligned(t, rows, cols):
        t, scale = dequantize_lazy(t, scale), None
    w = _apply(t, rows, cols, experts)
    if scale is None:
        return w, None
    blk = [(a // BLOCK, -(-b // BLOCK)) for a, b in rows] if rows else None
    bcol = (cols[0] // BLOCK, -(-cols[1] // BLOCK)) if cols else None
    return w, _apply(scale, blk, bcol, experts)


def _apply(t: LazyTensor, rows: list[Range] | None, cols: Range | None, experts: Range | None) -> LazyTensor:
    if experts is not None:
        t = take_rows(t, *experts)
    if rows is not None:
        pick = lambda m: concat_rows([take_rows(m, a, b) for a, b in rows])  # noqa: E731
        t = per_part(t, pick) if len(t.shape) == 3 else pick(t)
    if cols is not None:
        t = take_cols(t, *cols)
    return t


def _aligned(t: LazyTensor, rows: list[Range] | None, cols: Range | None) -> bool:
    n_rows, n_cols = t.shape[-2:]
    ok = lambda x, full: x % BLOCK == 0 or x == full  # noqa: E731
    return all(ok(a, n_rows) and ok(b, n_rows) for a, b in rows or []) and (
        cols is None or (ok(cols[0], n_cols) and ok(cols[1], n_cols))
    )
