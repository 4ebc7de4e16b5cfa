"""The main kernel benchmarks on one GPU: one table, one JSON.

    python benchmarks/kernels/all.py [--quick] [--out benchmarks/results/kernels_h200.json]
    python benchmarks/kernels/all.py --from-results     # the table of the recorded results, no GPU

Runs attention.py (MLA decode, extend attention, the two MLA prefill forms), gemm_moe.py (block-FP8
GEMM, fused MoE, routing) and head_bmm.py (w_kc/w_vc: einsum against the Triton head matmul with bf16
and FP8 weights), all in this folder. Each measures its ceilings in the same
run (device-to-device copy; bf16 matmul; torch._scaled_mm rowwise FP8) and the plain-torch
baseline of every kernel, and reports median time, GB/s or TFLOP/s and the fraction of ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import attention  # noqa: E402
import gemm_moe  # noqa: E402
import head_bmm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default configurations only")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "kernels_h200.json")
    ap.add_argument("--from-results", action="store_true", help="print the recorded results (no GPU needed)")
    args = ap.parse_args()
    if args.from_results:
        res = json.loads(args.out.read_text())
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        res = {}
        # each part is written as soon as it is done: a later failure keeps the earlier numbers
        res["attention"] = attention.run(args.quick)
        args.out.write_text(json.dumps(res, indent=1))
        res["gemm_moe"] = gemm_moe.run(args.quick)
        args.out.write_text(json.dumps(res, indent=1))
        res["head_bmm"] = head_bmm.run(res["gemm_moe"]["ceilings"], args.quick)
        args.out.write_text(json.dumps(res, indent=1))
    print(attention.table(res["attention"]))
    print()
    print(gemm_moe.table(res["gemm_moe"]))
    if "head_bmm" in res:
        print()
        print(head_bmm.table(res["head_bmm"]))


if __name__ == "__main__":
    main()
