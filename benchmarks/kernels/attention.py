"""Attention kernels on one GPU: MLA decode over a paged cache, and extend (prefill) attention.

Measures in the same run the ceilings (device-to-device copy bandwidth, bf16 matmul rate), then
each case's median time (triton.testing.do_bench, L2 flushed between calls, queries rotated over
several sets; the caches are far larger than L2), achieved bandwidth on the KV bytes and its
fraction of the copy bandwidth, TFLOP/s, the plain-torch reference's time, and the error against
the reference. A few launch configurations are tried per case; the default is marked.

    python benchmarks/kernels/attention.py [--out DIR] [--quick]   # writes DIR/kernels_attention.json

Also run by all.py, which records it in results/kernels_h200.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from mlac.kernels.attention.extend import default_config as extend_default  # noqa: E402
from mlac.kernels.attention.extend import extend_attention_ref, extend_attention_triton  # noqa: E402
from mlac.kernels.attention.mla_decode import mla_decode_ref, mla_decode_triton  # noqa: E402
from mlac.kernels.attention.mla_decode_plan import choose_num_splits  # noqa: E402
from mlac.kernels.attention.mla_decode_plan import default_config as decode_default  # noqa: E402
from mlac.runtime.model.attention import extend_absorbed, extend_mha, prefer_absorbed  # noqa: E402

KV_LORA, ROPE, PAGE = 512, 64, 64
N_ROT = 4  # query sets rotated through


def median_ms(fn, rep=200) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus bytes written."""
    n = 1 << 30
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * 2 * n / ms / 1e6


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, rep=300)
    return 2 * 8192**3 / ms / 1e9


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()


def decode_inputs(batch, heads, seq, kv_dtype):
    pages = seq // PAGE
    num_blocks = batch * pages
    cache = torch.randn(num_blocks, PAGE, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    kv_scale = None
    if kv_dtype != torch.bfloat16:
        kv_scale = torch.tensor([0.02], device="cuda")
        cache = (cache.float() / kv_scale).to(kv_dtype)
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, pages)  # scattered pages
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    qs = [
        (
            torch.randn(batch, heads, KV_LORA, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(N_ROT)
    ]
    return qs, cache, table, seq_lens, kv_scale


def decode_configs(heads, kv_dtype, quick=False):
    base = decode_default(heads, torch.device("cuda"), kv_dtype)
    if quick:
        return [("default", base)]
    if heads >= 64:
        alts = [dict(tile_in_page=False), dict(num_stages=3)]
    else:
        alts = [
            dict(num_stages=3),  # one KV buffer
            dict(tile_in_page=False),  # a block-table lookup per token
            dict(num_splits=4),  # fixed split count instead of choose_num_splits
        ]
    alts = [a for a in alts if {**base, **a} != base]
    # default timed again last: the spread between the two is the noise of the run
    return (
        [("default", base)] + [(f"alt{i}", {**base, **a}) for i, a in enumerate(alts)] + [("default2", base)]
    )


def bench_decode(name, batch, heads, seq, kv_dtype, copy_gbs, mm_tflops, quick=False):
    qs, cache, table, seq_lens, kv_scale = decode_inputs(batch, heads, seq, kv_dtype)
    scale = 1 / math.sqrt(192)
    kv_bytes = batch * seq * (KV_LORA + ROPE) * cache.element_size()
    flops = 2 * batch * heads * seq * (KV_LORA + ROPE + KV_LORA)
    ref_o, _ = mla_decode_ref(*qs[0], cache, table, seq_lens, scale, kv_scale)
    ref_ms = median_ms(lambda: mla_decode_ref(*qs[0], cache, table, seq_lens, scale, kv_scale), rep=100)
    rows = []
    for label, cfg in decode_configs(heads, kv_dtype, quick):
        row = dict(config=label, **{k: v for k, v in cfg.items()})
        try:
            splits = cfg.get("num_splits")
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            row["splits"] = splits or choose_num_splits(
                batch, -(-heads // cfg["BLOCK_H"]), seq, cfg["BLOCK_N"], sms * cfg["ctas_per_sm"]
            )
            o = mla_decode_triton(
                *qs[0], cache, table, seq_lens, scale, kv_scale, num_splits=splits, config=cfg
            )
            row["rel_err"] = rel_err(o, ref_o)
            rot = itertools.cycle(qs)

            def run(cfg=cfg, rot=rot, splits=splits):
                qn, qr = next(rot)
                mla_decode_triton(
                    qn, qr, cache, table, seq_lens, scale, kv_scale, num_splits=splits, config=cfg
                )

            ms = median_ms(run)
            row.update(
                ms=ms,
                kv_gbs=kv_bytes / ms / 1e6,
                frac_copy_bw=kv_bytes / ms / 1e6 / copy_gbs,
                tflops=flops / ms / 1e9,
                frac_matmul=flops / ms / 1e9 / mm_tflops,
            )
        except Exception as e:  # noqa: BLE001  (a config that does not fit is a result, not a crash)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
        rows.append(row)
        print(name, row, flush=True)
    return dict(
        name=name, kind="mla_decode", batch=batch, heads=heads, seq=seq, kv_dtype=str(kv_dtype), page=PAGE,
        kv_bytes=kv_bytes, flops=flops, ref_ms=ref_ms, configs=rows,
    )  # fmt: skip


def bench_extend(name, n_seq, q_len, prefix, heads, mm_tflops, absorbed=False):
    """MHA form (H heads of 192 / 128) or, with `absorbed`, the absorbed form's MQA (one latent head,
    576 / 512, v a view of k) over the same sequences."""
    d_qk, d_v, kv_heads = (KV_LORA + ROPE, KV_LORA, 1) if absorbed else (192, 128, heads)
    kv_len = prefix + q_len
    q = torch.randn(n_seq * q_len, heads, d_qk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n_seq * kv_len, kv_heads, d_qk, device="cuda", dtype=torch.bfloat16)
    v = k[:, :, :KV_LORA] if absorbed else torch.randn(n_seq * kv_len, heads, d_v, device="cuda").bfloat16()
    cu_q = torch.arange(0, n_seq + 1, device="cuda", dtype=torch.int32) * q_len
    cu_kv = torch.arange(0, n_seq + 1, device="cuda", dtype=torch.int32) * kv_len
    scale = 1 / math.sqrt(192)
    # causal pairs: each new token sees prefix + its index + 1 keys
    pairs = n_seq * (q_len * prefix + q_len * (q_len + 1) // 2)
    flops = 2 * heads * pairs * (d_qk + d_v)
    ref_o, _ = extend_attention_ref(q, k, v, cu_q, cu_kv, scale)
    ref_ms = median_ms(lambda: extend_attention_ref(q, k, v, cu_q, cu_kv, scale), rep=100)
    base = extend_default(d_qk, d_v, q.device)
    rows = []
    alts = [{**base, "num_stages": 2}]
    if absorbed:
        alts = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                for m, n, w, st in [(32, 32, 4, 2), (64, 32, 4, 1), (64, 64, 8, 1), (128, 32, 8, 1), (32, 64, 4, 2)]]  # fmt: skip
    for label, cfg in [("default", base), *((f"alt{i}", c) for i, c in enumerate(alts))]:
        row = dict(config=label, **cfg)
        try:
            o = extend_attention_triton(q, k, v, cu_q, cu_kv, q_len, scale, config=cfg)
            row["rel_err"] = rel_err(o, ref_o)
            ms = median_ms(
                lambda cfg=cfg: extend_attention_triton(q, k, v, cu_q, cu_kv, q_len, scale, config=cfg)
            )
            row.update(ms=ms, tflops=flops / ms / 1e9, frac_matmul=flops / ms / 1e9 / mm_tflops)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
        rows.append(row)
        print(name, row, flush=True)
    return dict(
        name=name, kind="extend_attention", n_seq=n_seq, q_len=q_len, prefix=prefix, heads=heads, kv_heads=kv_heads,
        d_qk=d_qk, d_v=d_v, flops=flops, ref_ms=ref_ms, configs=rows,
    )  # fmt: skip


def bench_extend_forms(n_seq, q_len, prefix, heads):
    """Whole MLA prefill attention of one layer in both exact forms (runtime/attention_forms.py),
    from q_nope/q_rope and the gathered latents to the [T, H, 128] output: MHA form (decompress
    K/V for every cached token) and absorbed form (MQA over the latents)."""
    t, s = n_seq * q_len, n_seq * (prefix + q_len)
    q = torch.randn(t, heads, 192, device="cuda", dtype=torch.bfloat16)
    q_nope, q_rope = q.split([128, ROPE], dim=-1)
    kv = torch.randn(s, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    w_kc = torch.randn(heads, 128, KV_LORA, device="cuda", dtype=torch.bfloat16) / KV_LORA**0.5
    w_vc = torch.randn(heads, KV_LORA, 128, device="cuda", dtype=torch.bfloat16) / KV_LORA**0.5
    cu_q = torch.arange(0, n_seq + 1, device="cuda", dtype=torch.int32) * q_len
    cu_kv = torch.arange(0, n_seq + 1, device="cuda", dtype=torch.int32) * (prefix + q_len)
    args = (q_nope, q_rope, kv, w_kc, w_vc, cu_q, cu_kv, q_len, 1 / math.sqrt(192))
    row = dict(n_seq=n_seq, q_len=q_len, prefix=prefix, heads=heads,
               rule_picks="absorbed" if prefer_absorbed([q_len] * n_seq, [prefix] * n_seq) else "mha")  # fmt: skip
    try:
        mha = extend_mha(*args)
        row["rel_diff"] = rel_err(extend_absorbed(*args), mha)
        row["mha_ms"] = median_ms(lambda: extend_mha(*args), rep=50)
        row["absorbed_ms"] = median_ms(lambda: extend_absorbed(*args), rep=50)
        row["faster"] = "absorbed" if row["absorbed_ms"] < row["mha_ms"] else "mha"
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        traceback.print_exc()
    print("extend forms", row, flush=True)
    return row


EXTEND_FORM_CASES = [  # (n_seq, q_len, prefix, heads): where does the absorbed form stop winning?
    *[(8, q, 4096, 16) for q in (1, 4, 16, 32, 64, 128, 256, 1024)],
    *[(1, q, 0, 16) for q in (16, 64, 256, 4096)],
    *[(8, q, 4096, 128) for q in (4, 64, 256)],
]


def best(rows):
    ok = [r for r in rows if "ms" in r]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--profile", metavar="HEADS:DTYPE", help="one decode case only (for ncu): 16:bf16")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.profile:
        heads, dtype = args.profile.split(":")
        kv_dtype = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
        qs, cache, table, seq_lens, kv_scale = decode_inputs(64, int(heads), 8192, kv_dtype)
        for _ in range(5):
            mla_decode_triton(*qs[0], cache, table, seq_lens, 0.07, kv_scale)
        torch.cuda.synchronize()
        return
    result = run(args.quick)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels_attention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    print(f"wrote {path}")


def run(quick: bool = False) -> dict:
    """Ceilings, then every decode and extend case; the result dict that is written as JSON."""
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    mm = matmul_tflops()
    print(f"{props.name}: copy {copy_gbs:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    cases = [
        bench_decode("decode bf16 H16 64x8192", 64, 16, 8192, torch.bfloat16, copy_gbs, mm, quick),
        bench_decode("decode bf16 H16 128x2048", 128, 16, 2048, torch.bfloat16, copy_gbs, mm, quick),
        bench_decode("decode bf16 H128 64x8192", 64, 128, 8192, torch.bfloat16, copy_gbs, mm, quick),
        bench_decode("decode fp8 H16 64x8192", 64, 16, 8192, torch.float8_e4m3fn, copy_gbs, mm, quick),
        bench_decode("decode fp8 H128 64x8192", 64, 128, 8192, torch.float8_e4m3fn, copy_gbs, mm, True),
        bench_extend("extend bf16 H16 4x4096 (prefix 0)", 4, 4096, 0, 16, mm),
        bench_extend("extend bf16 H16 8x1024 (prefix 3072)", 8, 1024, 3072, 16, mm),
        bench_extend("extend absorbed H16 8x64 (prefix 4096)", 8, 64, 4096, 16, mm, absorbed=True),
        bench_extend("extend absorbed H128 8x64 (prefix 4096)", 8, 64, 4096, 128, mm, absorbed=True),
    ]
    forms = [bench_extend_forms(*case) for case in EXTEND_FORM_CASES]
    return dict(
        device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        copy_gbs=copy_gbs, bf16_matmul_tflops=mm, cases=cases, extend_forms=forms,
    )  # fmt: skip


def table(result: dict) -> str:
    """One line per case: its default config and its best config."""
    versions = f"torch {result['torch']} | triton {result['triton']}"
    lines = [f"{result['device']} | {versions} | copy {result['copy_gbs']:.0f} GB/s | "
             f"bf16 matmul {result['bf16_matmul_tflops']:.0f} TFLOP/s"]  # fmt: skip
    head = f"{'case':38s} {'cfg':8s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s} {'ref ms':>8s}"
    lines.append(f"{head} {'err':>8s}")
    for c in result["cases"]:
        for r in [c["configs"][0], best(c["configs"])]:
            if r is None or "ms" not in r:
                lines.append(
                    f"{c['name']:38s} {r['config'] if r else '-':8s} failed: {r.get('error') if r else ''}"
                )
                continue
            gbs = f"{r['kv_gbs']:7.0f}" if "kv_gbs" in r else f"{'':7s}"
            frac = f"{100 * r['frac_copy_bw']:5.1f}%" if "frac_copy_bw" in r else f"{'':6s}"
            lines.append(
                f"{c['name']:38s} {r['config']:8s} {r['ms']:8.3f} {gbs} {frac} {r['tflops']:8.1f}"
                f" {c['ref_ms']:8.2f} {r['rel_err']:8.1e}"
            )
    lines.append(f"MLA prefill attention, whole layer: {'n_seq x q_len (prefix, H)':34s} {'mha ms':>8s} "
                 f"{'abs ms':>8s} {'faster':>9s} {'rule':>9s} {'diff':>8s}")  # fmt: skip
    for r in result.get("extend_forms", []):
        shape = f"{r['n_seq']} x {r['q_len']} (prefix {r['prefix']}, H{r['heads']})"
        if "error" in r:
            lines.append(f"{'':36s}{shape:34s} failed: {r['error']}")
            continue
        lines.append(f"{'':36s}{shape:34s} {r['mha_ms']:8.3f} {r['absorbed_ms']:8.3f} {r['faster']:>9s} "
                     f"{r['rule_picks']:>9s} {r['rel_diff']:8.1e}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
