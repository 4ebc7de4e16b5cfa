"""The MLA decode output on one GPU: head_bmm merging the split-KV partials (fused: decode_absorbed
up to FUSED_MERGE_MAX_SPLITS splits) against the separate merge kernel + head_bmm.

    python benchmarks/kernels/mla_out.py [--out results.json] [--max-context 32768]

V2-Lite attention shapes (16 heads, kv_lora 512, rope 64, v 128, 64-token pages), a block table
sized for --max-context tokens (num_splits as a CUDA graph of that context gets it), each request
holding --len tokens. Per (batch, len), the time of one CUDA graph of
  separate:  split-KV attention + merge kernel + head_bmm(o_lat, w_vc)  [+ act_quant for FP8 wo]
  fused:     split-KV attention + head_bmm(partials, w_vc)  [quantizing its output for FP8 wo]
for head_bmm's num_warps 4/8 and merge_chunk 2-16 (and the default config), and whether the
fused bits equal the separate ones (at equal head_bmm tiles).
Timing: timing.graph_us (median of replays, us per graph). The baseline is the separate launches, in
the same run: these are microseconds of latency-bound launches, not a bandwidth or FLOP ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import graph_us  # noqa: E402

from mlac.kernels.attention import head_bmm as HB  # noqa: E402
from mlac.kernels.attention.mla_decode import mla_decode_triton  # noqa: E402
from mlac.kernels.fp8_quant import act_quant  # noqa: E402

H, C, R, V, PAGE = 16, 512, 64, 128, 64


def inputs(b: int, length: int, max_context: int):
    """(q_lat, q_rope, cache, table, seq_lens, scale), w_vc: every request's pages distinct."""
    pages = -(-length // PAGE)
    table_width = -(-max_context // PAGE)
    cache = torch.randn(b * pages + 1, PAGE, C + R, device="cuda").bfloat16()
    table = torch.zeros(b, table_width, dtype=torch.int32, device="cuda")
    table[:, :pages] = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(b, H, C, device="cuda").bfloat16()
    q_rope = torch.randn(b, H, R, device="cuda").bfloat16()
    w_vc = (torch.randn(H, C, V, device="cuda") / C**0.5).bfloat16()
    return (q_lat, q_rope, cache, table, seq_lens, (C + R) ** -0.5), w_vc


def separate(args, w_vc, fp8: bool):
    o = HB.head_bmm(mla_decode_triton(*args), w_vc)
    return act_quant(o.flatten(1)) if fp8 else o


def fused(args, w_vc, fp8: bool, cfg: HB.HeadBmmConfig | None):
    act = HB.head_bmm(mla_decode_triton(*args, merge=False), w_vc, quant_out=fp8, config=cfg)
    return (act.q, act.scale) if fp8 else act


def same_bits(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def measure(b: int, length: int, max_context: int, fp8: bool) -> dict:
    args, w_vc = inputs(b, length, max_context)
    parts = mla_decode_triton(*args, merge=False)
    row = {"batch": b, "len": length, "max_context": max_context, "fp8_wo": fp8}
    row["num_splits"] = parts.o_part.shape[2] if isinstance(parts, tuple) else 1
    row["separate_us"] = graph_us([lambda: separate(args, w_vc, fp8)])
    base = HB.pick_config(b, whole_heads=True)
    ref = HB.head_bmm(mla_decode_triton(*args), w_vc, config=base)  # the same N tile: equal bits expected
    ref = act_quant(ref.flatten(1)) if fp8 else ref
    for warps in (4, 8):
        for chunk in (2, 4, 8, 16):
            cfg = dataclasses.replace(base, num_warps=warps, merge_chunk=chunk)
            name = f"fused_w{warps}_chunk{chunk}"
            row[f"{name}_us"] = graph_us([lambda cfg=cfg: fused(args, w_vc, fp8, cfg)])
            row[f"{name}_bitwise"] = same_bits(fused(args, w_vc, fp8, cfg), ref)
    row["fused_default_us"] = graph_us([lambda: fused(args, w_vc, fp8, None)])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--max-context", type=int, default=32768)
    args = ap.parse_args()
    rows = []
    for fp8 in (False, True):
        for b in (1, 8, 32):
            for length in (256, 4096, 32000):
                if length > args.max_context:
                    continue
                rows.append(measure(b, length, args.max_context, fp8))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
