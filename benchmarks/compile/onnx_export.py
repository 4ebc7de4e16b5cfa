"""ONNX export on CPU: time and peak RSS of `mlac export onnx`, and (--parity) onnxruntime against
mlac's CPU runtime on the exported graph.

    python benchmarks/compile/onnx_export.py ARTIFACT WORK_DIR [--link-weights] [--no-verify]
        [--parity [--unquantized BF16_ARTIFACT]] [--label NAME] [--json PATH]

The export runs as its own process; its peak RSS comes from wait4() (ru_maxrss), its time from the
wall clock (it includes re-hashing the artifact unless --no-verify, and the full onnx.checker pass).
The record has the weight files' bytes, the new disk they take (blocks of files that are not the
artifact's own inodes: a hard-linked file takes none), and what `onnx.checker.check_model(OUT_DIR/
model.onnx, full_check=True)` says of the finished OUT_DIR, run again after the export. --parity then
loads the graph in onnxruntime (CPU) and the artifact in mlac's runtime (float32) and compares a
32-token prefill's logits and the greedy tokens of prefill + 16 decode steps. Appends one record
to the JSON file (a list).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path


def export(artifact: Path, out: Path, flags: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `mlac export onnx ARTIFACT OUT FLAGS`."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mlac.cli", "export", "onnx", str(artifact), str(out), *flags]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"export failed: {' '.join(cmd)}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def new_disk_bytes(out: Path, artifact: Path) -> int:
    """Bytes allocated to OUT's files that are not hard links of the artifact's files."""
    theirs = {(p.stat().st_dev, p.stat().st_ino) for p in artifact.rglob("*") if p.is_file()}
    mine = [p.stat() for p in out.rglob("*") if p.is_file()]
    return sum(st.st_blocks * 512 for st in mine if (st.st_dev, st.st_ino) not in theirs)


def checker(out: Path) -> str:
    """What onnx's full check says of the finished OUT_DIR: "passed" or the error's first line."""
    import onnx

    try:
        onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    except onnx.checker.ValidationError as e:
        return f"refused: {str(e).splitlines()[0]}"
    return "passed"


def parity(artifact: Path, out: Path, unquantized: Path | None) -> dict:
    """onnxruntime vs the runtime: prefill logits (max and L2 relative) and 16 greedy decode steps;
    with `unquantized` (the bf16 artifact of an FP8 one), the FP8 quantization error beside it."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from mlac.runtime.engine.engine import Engine

    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()][1:]
    width = sess.get_inputs()[1].shape[2]
    ids = torch.randint(2, 1000, (32,), generator=torch.Generator().manual_seed(0)).tolist()

    def call(tokens, past):
        feed = {"input_ids": np.array([tokens], np.int64), **dict(zip(names, past, strict=True))}
        res = sess.run(None, feed)
        return res[0][0], res[1:]

    logits, cache = call(ids, [np.zeros((1, 0, width), np.float32) for _ in names])
    tokens = [int(logits[-1].argmax())]
    for _ in range(16):
        step, cache = call([tokens[-1]], cache)
        tokens.append(int(step[-1].argmax()))
    engine = Engine.from_artifact(artifact, dtype=torch.float32, num_blocks=16, block_size=16)
    ref = engine.score(ids).numpy()
    want = engine.generate(ids, max_tokens=17, ignore_eos=True).token_ids
    same = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), len(want))
    rel_l2 = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    extra = {}
    if unquantized is not None:
        base = Engine.from_artifact(unquantized, dtype=torch.float32, num_blocks=16, block_size=16).score(ids)
        extra = {"quantization_rel_l2": rel_l2(ref, base.numpy()), "quantization_top1": float(
            (ref.argmax(-1) == base.numpy().argmax(-1)).mean())}  # fmt: skip
    return {
        "prefill_tokens": len(ids),
        "logits_max_rel": float(np.abs(logits - ref).max() / np.abs(ref).max()),
        "logits_rel_l2": rel_l2(logits, ref),
        "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).mean()),
        "greedy_17_tokens_equal": tokens == want,
        "greedy_tokens_equal_before_first_difference": same,
        **extra,
        "onnxruntime": ort.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--link-weights", action="store_true", help="export with --link-weights")
    ap.add_argument("--no-verify", action="store_true", help="export with --no-verify")
    ap.add_argument("--label", default=None)
    ap.add_argument("--unquantized", type=Path, default=None, help="with --parity: the bf16 artifact")
    ap.add_argument(
        "--json", type=Path, default=Path(__file__).parents[1] / "results" / "onnx_export_cpu.json"
    )
    args = ap.parse_args()
    from mlac.core.artifact import Manifest

    m = Manifest.load(args.artifact)
    out = args.work / f"{args.artifact.name}-onnx"
    flags = [f for f, on in (("--link-weights", args.link_weights), ("--no-verify", args.no_verify)) if on]
    seconds, rss = export(args.artifact, out, flags)
    spec = json.loads((out / "mlac_onnx.json").read_text())
    data = sum((out / f).stat().st_size for f in spec["data"])
    record = {
        "label": args.label or args.artifact.name,
        "date": date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "layers": m.model.num_hidden_layers,
        "weights": m.quantization.scheme,
        "export_flags": flags,
        "weights_layout": spec["weights_layout"],
        "data_bytes": data,
        "new_disk_bytes": new_disk_bytes(out, args.artifact),
        "graph_bytes": (out / "model.onnx").stat().st_size,
        "export_seconds": round(seconds, 1),
        "export_peak_rss_gb": round(rss / 1e9, 3),
        "export_mb_per_s": round(data / 1e6 / seconds, 1),
        "onnx_checker_full_check": checker(out),
    }
    if args.parity:
        record["parity"] = parity(args.artifact, out, args.unquantized)
    print(json.dumps(record, indent=2))
    records = json.loads(args.json.read_text()) if args.json.is_file() else []
    args.json.write_text(json.dumps(records + [record], indent=2) + "\n")


if __name__ == "__main__":
    main()
