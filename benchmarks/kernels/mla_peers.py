"""mlac's MLA decode against FlashInfer's (BatchMLAPagedAttentionWrapper), side by side on one GPU.

    python benchmarks/kernels/mla_peers.py --json kernels_mla_peers_h200.json [--budget-s 420]
    bash benchmarks/kernels/mla_peers.sh OUT_DIR          # on the GPU host: wheels, JIT cache, budget

The absorbed MLA decode of one layer, one new token per sequence (kv_lora C = 512, rope R = 64, bf16):
queries q_lat [B, H, C] (q_nope already absorbed through w_kc) and q_rope [B, H, R], over a paged
latent cache, out o_lat [B, H, C]. Shapes: V2-Lite (16 heads) and V3 (128 heads, TP 1); batches 1,
32, 256; contexts 1k, 4k, 8k, 32k tokens per sequence (combinations past --mem-gb are skipped).

  mlac        mla_decode as decode_absorbed calls it: the pool [blocks, page, C + R] with the
              runtime's page (RuntimeOptions.block_size), pages scattered over the pool, a block
              table as wide as a CUDA graph's (--max-context tokens), the split count that
              decode_num_splits gives for that width; `mlac_us` includes the split-KV merge
              (the output FlashInfer gives), `mlac_unmerged_us` is the launch alone where
              decode_absorbed leaves the merge to head_bmm (splits <= FUSED_MERGE_MAX_SPLITS).
              HAZARD: at the runtime's 16-token pages a 32-token KV tile spans two pages, so the
              kernel looks a block up per token; --page 64 gives the one-lookup-per-tile path
              that attention.py and mla_rows.py measure
  flashinfer  BatchMLAPagedAttentionWrapper on the same bytes: ckv and kpe are views of mlac's pool
              (strided, as SGLang's flashinfer MLA backend passes its buffer), kv_indices each
              sequence's used block-table entries (`flashinfer_pages`); backend "auto" (what
              SGLang's `--attention-backend flashinfer` asks for: fa3 on sm90) is `peer_us`, fa2
              is timed too; plan() outside the timed region, use_cuda_graph=True

Times: the median of CUDA-graph replays (timing.graph_us). Each row: microseconds, mlac over the
peer (the ratio: < 1 is faster), and the fraction of the ceiling: the bytes the call must read (the
sequences' KV and the queries, `call_bytes`) over the device-copy bandwidth of this run, over the
time. Before timing, both are checked against mlac's float32 reference at one small shape (mixed
lengths, a partial page); each row records the largest |mlac - peer| too.
FlashInfer's JIT build runs in child processes while mlac's kernels compile and are checked; its
seconds are printed and recorded. Where flashinfer does not import or its build fails, one line says
so and the peer columns are null.
FlashMLA is not compared: its only wheel here (sgl-flash-mla 1.0.0) needs torch >= 2.14, and a
source build needs its pinned CUTLASS checkout and a torch-extension compile of its sm90 kernels,
neither carried to the GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps, graph_us  # noqa: E402

from mlac.kernels.attention.mla_decode import mla_decode, mla_decode_ref  # noqa: E402
from mlac.kernels.attention.mla_decode_plan import decode_num_splits  # noqa: E402
from mlac.runtime.model.attention import FUSED_MERGE_MAX_SPLITS  # noqa: E402
from mlac.runtime.worker.options import RuntimeOptions  # noqa: E402

DEV = "cuda"
C, R = 512, 64  # kv_lora_rank, qk_rope_head_dim (V2-Lite and V3)
SCALE = (128 + 64) ** -0.5  # (qk_nope + rope)^-0.5; its value does not change the time
SHAPES = {"v2-lite": 16, "v3": 128}  # heads per rank
BATCHES = (1, 32, 256)
CONTEXTS = (1024, 4096, 8192, 32768)
MAX_CONTEXT = 163840  # max_position_embeddings of V2-Lite and V3: a CUDA graph's table width
BACKENDS = ("auto", "fa2")  # FlashInfer MLA backends: "auto" is SGLang's choice
WORKSPACE = 512 << 20  # FlashInfer's float workspace (split-KV partials)
CHECK = dict(lens=(1, 37, 300, 1000), max_context=2048)  # the small check shape: a partial page


def call_bytes(batch: int, heads: int, context: int, kv_itemsize: int = 2, q_itemsize: int = 2) -> int:
    """The bytes one decode call must read: each sequence's `context` cached rows of C + R and the
    queries [B, H, C + R]. The output (written, [B, H, C]) is not counted."""
    return batch * context * (C + R) * kv_itemsize + batch * heads * (C + R) * q_itemsize


def peak_bytes(batch: int, heads: int, context: int, page: int) -> int:
    """An upper bound on what a row allocates: the pool (its pages and the scratch block) and
    mlac's split-KV partials at the most splits choose_num_splits gives (64, float32 o and lse)."""
    pool = (batch * -(-context // page) + 1) * page * (C + R) * 2
    return pool + batch * heads * 64 * (C + 1) * 4 + WORKSPACE


def decode_inputs(lens, heads: int, page: int, max_context: int, device, seed: int = 0) -> dict:
    """mla_decode's inputs for len(lens) sequences as the runtime lays them out: a pool
    [blocks + 1, page, C + R] (its last block the scratch block, as PagedKVCache), each sequence's
    ceil(len / page) blocks drawn at random from it (a fragmented pool), the block table [B,
    ceil(max_context / page)] int32 zero past them, seq_lens [B] int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    blocks = sum(pages)
    table = torch.zeros(len(lens), -(-max_context // page), dtype=torch.int32, device=device)
    order = torch.randperm(blocks, generator=gen, device=device).to(torch.int32)
    for i, (start, n) in enumerate(zip(torch.tensor([0, *pages]).cumsum(0).tolist(), pages, strict=False)):
        table[i, :n] = order[start : start + n]
    # drawn in bf16: a float32 draw of V3's 256 x 32k pool would take twice its 9.7 GB
    kv = torch.randn(blocks + 1, page, C + R, generator=gen, device=device, dtype=torch.bfloat16)
    q = torch.randn(len(lens), heads, C + R, generator=gen, device=device, dtype=torch.bfloat16)
    return dict(
        q_lat=q[..., :C].contiguous(),  # [B, H, C]
        q_rope=q[..., C:].contiguous(),  # [B, H, R]
        kv=kv,  # [blocks + 1, page, C + R]
        table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


def flashinfer_pages(table: torch.Tensor, seq_lens: torch.Tensor, page: int):
    """mlac's block table [B, W] and seq_lens [B] -> FlashInfer's paged layout over the same pool:
    kv_indptr [B + 1] (prefix sums of the pages each sequence uses), kv_indices [sum of pages]
    (sequence b's first ceil(seq_len / page) table entries, in order) and kv_len [B], int32.
    The pool itself is shared: FlashInfer's ckv and kpe caches are views of it."""
    used = (seq_lens.long() + page - 1) // page  # [B]
    indptr = torch.zeros(len(used) + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = used.cumsum(0)
    keep = torch.arange(table.shape[1], device=table.device)[None, :] < used[:, None]  # [B, W]
    return indptr, table[keep].to(torch.int32), seq_lens.to(torch.int32)


def paged_ref(q_lat, q_rope, ckv, kpe, indptr, indices, kv_len, scale: float) -> torch.Tensor:
    """Float32 attention read through FlashInfer's layout (ckv [P, page, C], kpe [P, page, R]),
    one sequence at a time -> o [B, H, C] in q's dtype: what a correct conversion gives mla_decode_ref."""
    out = []
    for b in range(q_lat.shape[0]):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        n = int(kv_len[b])
        lat = ckv[pages].reshape(-1, ckv.shape[-1])[:n].float()  # [n, C]
        rope = kpe[pages].reshape(-1, kpe.shape[-1])[:n].float()  # [n, R]
        s = (q_lat[b].float() @ lat.T + q_rope[b].float() @ rope.T) * scale  # [H, n]
        out.append(torch.softmax(s, dim=-1) @ lat)
    return torch.stack(out).to(q_lat.dtype)


def cases(batches, contexts, page: int, mem_gb: float):
    """(shape, heads, batch, context) of every row, and those skipped for --mem-gb."""
    rows, skipped = [], []
    for shape, heads in SHAPES.items():
        for b in batches:
            for ctx in contexts:
                fits = peak_bytes(b, heads, ctx, page) <= mem_gb * 2**30
                (rows if fits else skipped).append((shape, heads, b, ctx))
    return rows, skipped


# --------------------------------------------------------------------------------------------
# FlashInfer
# --------------------------------------------------------------------------------------------


class Peer:
    """One FlashInfer MLA wrapper planned for one set of inputs (plan() outside any timing), its
    run() writing into a fixed output: a graph-capturable call."""

    def __init__(self, backend: str, inp: dict, page: int, workspace: torch.Tensor):
        import flashinfer

        b, heads = inp["q_lat"].shape[:2]
        dev = inp["q_lat"].device
        indptr, indices, kv_len = flashinfer_pages(inp["table"], inp["seq_lens"], page)
        self.ckv, self.kpe = inp["kv"][..., :C], inp["kv"][..., C:]  # views of mlac's pool
        qo = torch.arange(b + 1, dtype=torch.int32, device=dev)  # one query row per sequence
        bufs = dict(qo_indptr=qo.clone(), kv_indptr=torch.empty_like(indptr),
                    kv_indices=torch.empty_like(indices), kv_len_arr=torch.empty_like(kv_len))  # fmt: skip
        self.w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, backend=backend, **bufs
        )
        self.backend = getattr(self.w, "_backend", backend)  # "auto" resolved
        self.w.plan(
            qo, indptr, indices, kv_len, heads, C, R, page, False, SCALE, torch.bfloat16, torch.bfloat16
        )
        self.q_lat, self.q_rope = inp["q_lat"], inp["q_rope"]
        self.out = torch.empty_like(self.q_lat)  # [B, H, C]

    def __call__(self) -> torch.Tensor:
        return self.w.run(self.q_lat, self.q_rope, self.ckv, self.kpe, out=self.out)


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001  (a missing or broken install is a result, said in one line)
        print(f"flashinfer does not import ({type(e).__name__}: {str(e)[:120]}): mlac only", flush=True)
        return None
    return flashinfer.__version__


BUILT = "mla_peers build: "  # the marker of a build child's record in its log


def build_peer(backend: str, page: int) -> None:
    """Child process: JIT-build (and load) FlashInfer's MLA module of `backend` through one tiny
    plan and run; its last line on stdout is BUILT + JSON {"backend", "resolved", "seconds", "error"}
    (seconds: the plan that compiles and loads, and the run)."""
    t0, resolved, error = None, backend, None
    try:
        inp = decode_inputs([page + 1], 16, page, 4 * page, DEV)
        workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEV)
        t0 = time.monotonic()
        peer = Peer(backend, inp, page, workspace)
        resolved = peer.backend
        peer()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        lines = str(e).strip().splitlines() or [""]
        error = f"{type(e).__name__}: {lines[-1][:300]}"  # a compile error's last line; the log has it all
        import traceback

        traceback.print_exc()
    seconds = None if t0 is None else round(time.monotonic() - t0, 1)
    rec = dict(backend=backend, resolved=resolved, seconds=seconds, error=error)
    print(BUILT + json.dumps(rec), flush=True)


def start_builds(backends, page: int, log: Path) -> dict:
    """One child per backend, building in parallel, each writing to its own log (`log` with the
    backend's name added): {backend: (Popen, its log path)}."""
    script, children = str(Path(__file__).resolve()), {}
    for b in backends:
        path = log.with_name(f"{log.stem}_{b}{log.suffix}")
        with open(path, "w") as f:  # the child keeps its own descriptor of it
            cmd = [sys.executable, script, "--build-peer", b, "--page", str(page)]
            children[b] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), path)
    return children


def finish_builds(children: dict, deadline: float) -> dict:
    """{backend: the child's record}, waiting until `deadline` (time.monotonic()) at most; one line
    printed per backend: built in how many seconds, or why not."""
    builds = {}
    for backend, (child, path) in children.items():
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
            recs = [
                ln[len(BUILT) :]
                for ln in path.read_text(errors="replace").splitlines()
                if ln.startswith(BUILT)
            ]
            rec = (
                json.loads(recs[-1])
                if recs
                else dict(error=f"the build exited {child.returncode}: see {path}")
            )
        except subprocess.TimeoutExpired:
            child.kill()
            rec = dict(error="the build ran past its time budget")
        r = builds[backend] = {"backend": backend, "resolved": backend, "seconds": None, **rec}
        state = f"failed: {r['error'][:160]}" if r["error"] else f"built and loaded in {r['seconds']} s"
        print(f"flashinfer {backend} ({r['resolved']}) JIT {state}", flush=True)
    return builds


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def mlac_calls(inp: dict):
    """(merged call, unmerged call or None, splits): mla_decode as decode_absorbed makes it."""
    args = (inp["q_lat"], inp["q_rope"], inp["kv"], inp["table"], inp["seq_lens"], SCALE, None)
    splits = decode_num_splits(inp["q_lat"], inp["kv"], inp["table"])
    merged = partial(mla_decode, *args, num_splits=splits)
    unmerged = (
        partial(mla_decode, *args, num_splits=splits, merge=False)
        if 1 < splits <= FUSED_MERGE_MAX_SPLITS
        else None
    )
    return merged, unmerged, splits


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check(page: int, peers, workspace, quiet: bool = False) -> dict:
    """Both kernels against mla_decode_ref (and the peer against mlac) at the small check shape,
    per head count: max |difference| of the bf16 outputs. `quiet`: no line printed (a warm-up)."""
    result = {}
    for shape, heads in SHAPES.items():
        inp = decode_inputs(CHECK["lens"], heads, page, CHECK["max_context"], DEV, seed=1)
        args = (inp["q_lat"], inp["q_rope"], inp["kv"], inp["table"], inp["seq_lens"], SCALE)
        ref, _ = mla_decode_ref(*args)
        o = mlac_calls(inp)[0]()
        rec = {"mlac_vs_ref": max_err(o, ref)}
        for backend in peers:
            try:
                p = Peer(backend, inp, page, workspace)()
                rec[f"{backend}_vs_ref"], rec[f"{backend}_vs_mlac"] = max_err(p, ref), max_err(p, o)
            except Exception as e:  # noqa: BLE001
                rec[f"{backend}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        result[shape] = rec
        if not quiet:
            print(f"check {shape} H={heads} lens {list(CHECK['lens'])}: " + ", ".join(
                f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)  # fmt: skip
    return result


def time_row(shape, heads, b, ctx, page, max_context, bw, peers, workspace) -> dict:
    inp = decode_inputs([ctx] * b, heads, page, max_context, DEV, seed=b * 7 + ctx)
    merged, unmerged, splits = mlac_calls(inp)
    floor_us = call_bytes(b, heads, ctx) / (bw * 1e3)
    row = dict(kernel="mla_decode bf16", shape=shape, heads=heads, batch=b, context=ctx, splits=splits,
               mlac_us=round(graph_us([merged]), 2), mlac_unmerged_us=unmerged and round(graph_us([unmerged]), 2),
               peer=None, peer_us=None, ratio=None, peer_fraction_of_ceiling=None, peers={}, max_diff=None)  # fmt: skip
    row["mlac_fraction_of_ceiling"] = round(floor_us / row["mlac_us"], 3)
    o = merged()
    for i, backend in enumerate(peers):
        try:
            peer = Peer(backend, inp, page, workspace)
            us = round(graph_us([peer]), 2)
        except Exception as e:  # noqa: BLE001  (a shape the backend refuses is a result)
            row["peers"][backend] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        row["peers"][backend] = dict(
            resolved=peer.backend, us=us, fraction_of_ceiling=round(floor_us / us, 3)
        )
        if i == 0:  # the first backend is the peer of the ratio
            row.update(peer=f"flashinfer {peer.backend}", peer_us=us, ratio=round(row["mlac_us"] / us, 3),
                       peer_fraction_of_ceiling=round(floor_us / us, 3), max_diff=max_err(peer(), o))  # fmt: skip
        del peer
    return row


def line(r: dict) -> str:
    s = f"{r['shape']:8} B={r['batch']:4} ctx={r['context']:6} splits {r['splits']:2}  mlac {r['mlac_us']:8.2f} us"
    s += f" ({100 * r['mlac_fraction_of_ceiling']:3.0f}%)"
    for backend, p in r["peers"].items():
        s += f"  {p.get('resolved', backend)} " + (
            f"{p['us']:8.2f} us ({100 * p['fraction_of_ceiling']:3.0f}%)" if "us" in p else "error"
        )
    if r["ratio"] is not None:
        s += f"  ratio {r['ratio']:.2f}  diff {r['max_diff']:.1e}"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--page", type=int, default=RuntimeOptions.block_size, help="tokens per block (the runtime's)"
    )
    ap.add_argument("--max-context", type=int, default=MAX_CONTEXT, help="block-table width in tokens")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument(
        "--backends", default=",".join(BACKENDS), help="FlashInfer MLA backends; the first is the peer"
    )
    ap.add_argument("--mem-gb", type=float, default=32.0, help="skip rows whose buffers exceed this")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the rows left after this many seconds")
    ap.add_argument(
        "--build-timeout-s", type=float, default=300.0, help="give FlashInfer's JIT build up to this"
    )
    ap.add_argument(
        "--build-log", type=Path, default=Path("/tmp/flashinfer_build.log"), help="one per backend"
    )
    ap.add_argument("--build-peer", help=argparse.SUPPRESS)  # child mode: build one backend
    args = ap.parse_args()
    if args.build_peer:
        return build_peer(args.build_peer, args.page)
    t0 = time.monotonic()
    deadline = t0 + (args.budget_s or 1e9)
    fi_version = flashinfer_version()
    backends = [b for b in args.backends.split(",") if b] if fi_version else []
    children = start_builds(backends, args.page, args.build_log)
    import triton

    record = {"benchmark": "MLA decode: mlac vs FlashInfer", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "flashinfer": fi_version, "page": args.page,
              "max_context": args.max_context,
              "command": "python benchmarks/kernels/mla_peers.py " + " ".join(sys.argv[1:])}  # fmt: skip
    print(
        " | ".join(f"{k} {record[k]}" for k in ("device", "torch", "triton", "cuda", "flashinfer", "page")),
        flush=True,
    )
    torch.manual_seed(0)
    record["copy_gb_per_s"] = bw = round(copy_gbps(), 1)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEV)
    check(args.page, [], workspace, quiet=True)  # mlac's kernels compile while FlashInfer builds
    record["flashinfer_builds"] = builds = finish_builds(children, min(deadline, t0 + args.build_timeout_s))
    peers = [b for b in backends if not builds[b]["error"]]
    record["check_max_abs_err"] = check(args.page, peers, workspace)
    batches, contexts = ([int(x) for x in a.split(",")] for a in (args.batches, args.contexts))
    todo, skipped = cases(batches, contexts, args.page, args.mem_gb)
    record.update(
        rows=[], skipped=[dict(shape=s, batch=b, context=c, why="memory") for s, _, b, c in skipped]
    )
    for shape, heads, b, ctx in todo:
        if time.monotonic() > deadline:
            record["skipped"].append(dict(shape=shape, batch=b, context=ctx, why="time"))
            continue
        try:
            row = time_row(shape, heads, b, ctx, args.page, args.max_context, bw, peers, workspace)
            print(line(row), flush=True)
        except Exception as e:  # noqa: BLE001  (an out-of-memory row is a result; the others still run)
            row = dict(
                shape=shape, heads=heads, batch=b, context=ctx, error=f"{type(e).__name__}: {str(e)[:200]}"
            )
            print(f"{shape:8} B={b:4} ctx={ctx:6} failed: {row['error']}", flush=True)
        record["rows"].append(row)
        record["seconds"] = round(time.monotonic() - t0, 1)
        if args.json:  # after every row: a run stopped by its caller's timeout keeps what it measured
            args.json.write_text(json.dumps(record, indent=2) + "\n")
        torch.cuda.empty_cache()
    if record["skipped"]:
        print(
            "skipped: "
            + ", ".join(
                f"{r['shape']} B={r['batch']} ctx={r['context']} ({r['why']})" for r in record["skipped"]
            )
        )
    record["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "WARNING")
    main()
