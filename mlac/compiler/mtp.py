"""The checkpoint's MTP (NextN) layers, compiled like a decoder layer into `mtp.{k}.*`.

V3 stores MTP layer k at `model.layers.{N+k}.` (N = num_hidden_layers): a decoder block, `enorm`,
`hnorm`, `eh_proj` [D, 2D], `shared_head.norm`, and copies of the embedding and the LM head.
The block, norms and eh_proj go through the same passes as a layer (rope, fuse, absorb, shard,
fp8; eh_proj is replicated and FP8 like any linear weight), then are renamed `layers.{N+k}.` ->
`mtp.{k}.`. The copies of the embedding and head are compared with the main ones: equal (V3),
the runtime shares the main tensors and none is written; else they are written, vocab-parallel,
as `mtp.{k}.embed` and `mtp.{k}.head`.

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])   # embedding half first (V3, vLLM, SGLang)
    g = norm(block(x))                                 # the hidden state the head reads
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlac.compiler.reader import Checkpoint, read_globals, read_mtp, read_mtp_copies
from mlac.core.artifact import CompileOptions, MTPInfo
from mlac.core.lazy import LazyTensor
from mlac.passes import PassContext, absorb, fp8, fuse, rope, shard

LAYER_PASSES = (rope, fuse, absorb)  # as the main layers (pipeline.LAYER_PASSES)


def compiled_layers(ckpt: Checkpoint, options: CompileOptions) -> list[int]:
    """The source indices of the MTP layers this compile writes (none with --no-mtp)."""
    return list(ckpt.mtp_layers) if options.mtp else []


def mtp_group(
    ckpt: Checkpoint, k: int, options: CompileOptions, on_read: Callable[[int], None] | None = None
) -> list[dict[str, LazyTensor]]:
    """MTP layer k's final lazy tensors, one dict per rank, under `mtp.{k}.` names."""
    cfg = ckpt.config
    n = cfg.num_hidden_layers + k
    ctx = PassContext(cfg, options, n)
    tensors = read_mtp(ckpt, n, keep_fp8=options.fp8, on_read=on_read)
    for p in LAYER_PASSES:
        tensors = p.run(tensors, ctx)
    ranks = [_rename(fp8.run(rank, ctx), f"layers.{n}.", f"mtp.{k}.") for rank in shard.run(tensors, ctx)]
    copies = own_copies(ckpt, n, on_read)
    if copies:
        top = PassContext(cfg, options, None)
        named = {f"mtp.{k}.{name}": t for name, t in copies.items()}
        ranks = [r | c for r, c in zip(ranks, shard.run(named, top), strict=True)]
    return ranks


def own_copies(ckpt: Checkpoint, n: int, on_read=None) -> dict[str, LazyTensor]:
    """The MTP layer's embedding / head where they differ from the main ones (V3: none)."""
    main = read_globals(ckpt, on_read)
    mine = read_mtp_copies(ckpt, n, on_read)
    return {name: t for name, t in mine.items() if not torch.equal(t.load(), main[name].load())}


def mtp_info(ckpt: Checkpoint, options: CompileOptions, rank0: dict[str, object]) -> MTPInfo | None:
    """The manifest's record of what was compiled (None: no MTP layer in the artifact)."""
    layers = compiled_layers(ckpt, options)
    if not layers:
        return None
    return MTPInfo(
        source_layers=layers,
        prefixes=[f"mtp.{k}" for k in range(len(layers))],
        shared_embed=all(f"mtp.{k}.embed" not in rank0 for k in range(len(layers))),
        shared_head=all(f"mtp.{k}.head" not in rank0 for k in range(len(layers))),
        tensors=sum(1 for name in rank0 if name.startswith("mtp.")),
    )


def _rename(tensors: dict[str, LazyTensor], old: str, new: str) -> dict[str, LazyTensor]:
    return {new + name.removeprefix(old): t for name, t in tensors.items()}
