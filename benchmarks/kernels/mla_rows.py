"""MLA decode rows of one sequence grouped (one program loads each KV tile for all its rows) against one
program per row, on one GPU: the rows of a cached prompt's suffix and of a speculative verify.

    python benchmarks/kernels/mla_rows.py [--json results.json] [--max-context 8192] [--sweep]

Cases (kv_lora 512, rope 64, 64-token pages, bf16 queries; bf16 and FP8 e4m3 caches):
  prefix64   64 rows of one sequence after a 2,000-token prefix (a flattened 64-token suffix), 16 heads
  verify4    4 rows of one sequence after 4,096 tokens (speculative verify, K = 3), 16 heads
  decodeB    B = 1, 32, 256 sequences of 2,000 tokens, one row each (pure decode: must not regress;
             the rule, prefer_row_groups, keeps it per-row)
  v3_prefix64  64 rows after 2,000 tokens, 64 heads (V3's 128 heads at tp 2): those never group
Each form runs mla_decode_triton as decode_absorbed does (split-KV and merge; the split count
from decode_num_splits for a block table of --max-context tokens, as a CUDA graph gets it), timed
by timing.graph_us (one CUDA graph, warm replays, CUDA events, median). `kv_gbps`: the
distinct KV bytes of the case over the time, and `of_copy`: that as a fraction of the measured
device-to-device copy bandwidth (the ceiling: every KV byte read once). `max_diff`: grouped
against per-row outputs. End to end, `DecodeGraphs(row_groups=False)` captures no grouped graph.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps, graph_us  # noqa: E402

from mlac.kernels.attention.mla_decode import mla_decode_triton  # noqa: E402
from mlac.kernels.attention.mla_decode_plan import (  # noqa: E402
    decode_group_rows,
    decode_num_splits,
    prefer_row_groups,
    row_groups,
)

C, R, PAGE = 512, 64, 64
DEVICE = "cuda"
CASES = {  # name: (heads, ctx_lens, q_lens)
    "prefix64": (16, [2000], [64]),
    "verify4": (16, [4096], [4]),
    "decode1": (16, [1999], [1]),
    "decode32": (16, [1999] * 32, [1] * 32),
    "decode256": (16, [1999] * 256, [1] * 256),
    "v3_prefix64": (64, [2000], [64]),
}


def inputs(heads: int, ctx_lens: list[int], q_lens: list[int], max_context: int, kv_dtype: torch.dtype):
    """mla_decode's args for the flattened rows (row j of sequence i over ctx + j + 1 tokens), every
    sequence's pages distinct, the table `max_context` tokens wide; kv_scale; distinct KV bytes."""
    dev = DEVICE
    width = -(-max_context // PAGE)
    totals = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    pages = [-(-n // PAGE) for n in totals]
    assert max(pages) <= width, f"--max-context {max_context} is below a sequence of {max(totals)} tokens"
    cache = torch.randn(sum(pages) + 1, PAGE, C + R, device=dev)
    kv_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        kv_scale = torch.tensor([0.05], device=dev)
        cache = (cache / kv_scale).to(kv_dtype)
    else:
        cache = cache.to(kv_dtype)
    tables, first = [], 0
    for p in pages:
        tables.append(list(range(first, first + p)) + [0] * (width - p))
        first += p
    rows = [(i, c + j + 1) for i, (c, q) in enumerate(zip(ctx_lens, q_lens, strict=True)) for j in range(q)]
    table = torch.tensor([tables[i] for i, _ in rows], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device=dev)
    q_lat = torch.randn(len(rows), heads, C, device=dev).bfloat16()
    q_rope = torch.randn(len(rows), heads, R, device=dev).bfloat16()
    kv_bytes = sum(totals) * (C + R) * cache.element_size()
    return (q_lat, q_rope, cache, table, seq_lens, (C + R) ** -0.5), kv_scale, kv_bytes


def measure(name: str, kv_dtype: torch.dtype, max_context: int, ceiling: float) -> dict:
    heads, ctx_lens, q_lens = CASES[name]
    args, kv_scale, kv_bytes = inputs(heads, ctx_lens, q_lens, max_context, kv_dtype)
    q_lat, cache, table = args[0], args[2], args[3]
    rows = decode_group_rows(heads, q_lat.device, kv_dtype)
    groups = row_groups(ctx_lens, q_lens, rows, q_lat.device)
    forms = {
        "per_row": dict(num_splits=decode_num_splits(q_lat, cache, table)),
        "grouped": dict(num_splits=decode_num_splits(q_lat, cache, table, grouped=True), row_groups=groups),
    }
    row = {"case": name, "kv": str(kv_dtype).removeprefix("torch."), "rows": len(q_lat), "heads": heads}
    row |= {"group_rows": rows, "rule_grouped": prefer_row_groups(q_lens, heads, q_lat.device, kv_dtype)}
    out = {}
    for form, kw in forms.items():
        call = lambda kw=kw: mla_decode_triton(*args, kv_scale=kv_scale, **kw)  # noqa: E731
        out[form] = call()
        us = graph_us([call], replays=20)
        gbps = kv_bytes / us / 1e3
        row |= {f"{form}_us": round(us, 2), f"{form}_splits": kw["num_splits"]}
        row |= {f"{form}_kv_gbps": round(gbps, 1), f"{form}_of_copy": round(gbps / ceiling, 3)}
    row["speedup"] = round(row["per_row_us"] / row["grouped_us"], 2)
    row["max_diff"] = (out["grouped"].float() - out["per_row"].float()).abs().max().item()
    return row


SWEEP_CASES = [("prefix64", torch.bfloat16), ("prefix64", torch.float8_e4m3fn), ("verify4", torch.bfloat16)]


def sweep_configs() -> list[dict]:
    """Grouped-form launch settings to time (BLOCK_H 16: V2-Lite's heads)."""
    return [
        dict(
            BLOCK_H=16,
            ROWS=rows,
            BLOCK_N=bn,
            num_warps=w,
            num_stages=st,
            ctas_per_sm=c,
            tile_in_page=True,
            min_split_tiles=2,
        )  # fmt: skip
        for rows in (2, 4, 8)
        for bn in (32, 64)
        for w, st in ((4, 3), (8, 2), (8, 3))
        for c in (1, 2)
    ]


def sweep(max_context: int, ceiling: float) -> list[dict]:
    """The grouped form of SWEEP_CASES under each of sweep_configs(), fastest first per case, with
    the per-row default of the same case; configs that fail or differ from per-row are dropped."""
    out = []
    for name, kv_dtype in SWEEP_CASES:
        heads, ctx_lens, q_lens = CASES[name]
        args, kv_scale, kv_bytes = inputs(heads, ctx_lens, q_lens, max_context, kv_dtype)
        q_lat, cache, table = args[0], args[2], args[3]
        ref = mla_decode_triton(*args, kv_scale=kv_scale)
        per_row_us = graph_us([lambda a=args, s=kv_scale: mla_decode_triton(*a, kv_scale=s)], replays=20)
        rows = []
        for cfg in sweep_configs():
            groups = row_groups(ctx_lens, q_lens, cfg["ROWS"], q_lat.device)
            splits = decode_num_splits(q_lat, cache, table, cfg, grouped=True)
            kw = dict(kv_scale=kv_scale, config=cfg, num_splits=splits, row_groups=groups)
            try:
                diff = (mla_decode_triton(*args, **kw).float() - ref.float()).abs().max().item()
                if not diff < 5e-2:
                    raise ValueError(f"max diff {diff}")
                us = graph_us([lambda a=args, kw=kw: mla_decode_triton(*a, **kw)], replays=20)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the sweep
                print(f"  {name} {cfg} FAILED {exc!r}"[:240], file=sys.stderr)
                continue
            rows.append(
                {
                    "config": cfg,
                    "splits": splits,
                    "us": round(us, 2),
                    "of_copy": kv_bytes / us / 1e3 / ceiling,
                }
            )
        rows.sort(key=lambda r: r["us"])
        kv = str(kv_dtype).removeprefix("torch.")
        out.append({"case": name, "kv": kv, "per_row_us": round(per_row_us, 2), "grouped": rows})
        for r in rows[:3]:
            print(f"  sweep {name:10} {kv:14} per-row {per_row_us:7.1f} us  grouped {r['us']:7.1f} us  "
                  f"splits {r['splits']:3}  {r['config']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the rows (and the device) here")
    ap.add_argument("--max-context", type=int, default=8192, help="block-table width in tokens")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument(
        "--sweep", action="store_true", help="also time the grouped form under other launch settings"
    )
    args = ap.parse_args()
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {ceiling:.0f} GB/s (the ceiling)")
    head = f"{'case':12} {'kv':12} {'rows':>4} {'heads':>5} {'per-row us':>10} {'grouped us':>10} "
    print(head + f"{'speedup':>7} {'of copy (per-row / grouped)':>28} {'rule':>7}")
    results = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for name in args.cases:
            r = measure(name, kv_dtype, args.max_context, ceiling)
            results.append(r)
            frac = f"{r['per_row_of_copy']:.2f} / {r['grouped_of_copy']:.2f}"
            rule = "grouped" if r["rule_grouped"] else "per-row"
            print(
                f"{r['case']:12} {r['kv']:12} {r['rows']:>4} {r['heads']:>5} {r['per_row_us']:>10.1f} "
                f"{r['grouped_us']:>10.1f} {r['speedup']:>7.2f} {frac:>28} {rule:>7}",
                flush=True,
            )
    swept = sweep(args.max_context, ceiling) if args.sweep else []
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": ceiling}
        meta["max_context"] = args.max_context
        args.json.write_text(json.dumps({"meta": meta, "rows": results, "sweep": swept}, indent=1) + "\n")


if __name__ == "__main__":
    main()
