"""The perplexity-delta table of a trained checkpoint: each compile option against bf16, via `mlac eval`.

    python benchmarks/train/train_eval.py CKPT_DIR OUT_DIR [--device cuda|cpu] [--max-tokens N]
        [--cpu-max-tokens N] [--top1-tokens N]

CKPT_DIR is a checkpoint of benchmarks/train/train_small.py. OUT_DIR (new or empty) gets

    held_out.txt     the stdlib files of train_data's held-out split (the first HELD_BYTES)
    calibration.txt  stdlib files of the TRAIN split (every CALIB_EVERY-th, CALIB_BYTES): the text
                     the calibrated rows' FP8 KV scales are measured on (never the held-out text)
    art/<row>/       the compiled artifacts;  logs/  each command's output;  eval/  each eval's record
    table.json, table.md

Every row is compiled and scored by the CLI, as a user runs it (`python -m mlac.cli compile`, then
`mlac eval --json`), in windows of the checkpoint's training length (rope_scaling's
original_max_position_embeddings), non-overlapping. The rows:

    bf16                       the reference of the rows below on --device
    fp8                        compile --fp8 (block 128x128 e4m3 weights, W8A8)
    kv-e4m3, kv-e5m2           --kv-cache-dtype fp8_e4m3 / fp8_e5m2, every layer's scale 1.0
    kv-e4m3-cal, kv-e5m2-cal   the same with --calibration-text calibration.txt (per-layer scales)
    bf16-cpu                   the bf16 artifact again, 1 rank on CPU: the reference of
    tp2                        compile --tp 2, its two ranks on CPU (gloo), one process each

Eval dtype: bfloat16 on CUDA, float32 on CPU. The tp2 pair always runs on CPU in float32 over the
first --cpu-max-tokens tokens (one GPU cannot hold two ranks; CPU ranks talk through gloo), so its
delta is against bf16-cpu, same tokens, same dtype, not against the bf16 row. Top-1 agreement (how
often a row's argmax equals its reference's, over the first --top1-tokens scored positions) is
measured in this process through the same Engine.score that `mlac eval` calls.
A row that fails is recorded with its error; the exit status is then 1, after the table is written.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlac.core.errors import MlacError
from mlac.synth import train_data

HELD_BYTES = 400_000  # about 100k tokens of the small config's tokenizer: more than --max-tokens
CALIB_BYTES = 60_000  # about 15k tokens: compile calibrates on the first calibrate.MAX_TOKENS (8192)
CALIB_EVERY = 10
CALIB = "{calibration}"  # stands for calibration.txt in a row's compile arguments
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    """One line of the table: how its artifact is compiled, where it is scored, against what."""

    name: str
    compile_args: tuple[str, ...]
    artifact: str  # art/<artifact>: rows may share one (bf16 and bf16-cpu)
    on_cpu: bool  # scored on CPU in float32 (the tp2 pair), else on --device
    reference: str  # the row its delta and top-1 are measured against
    what: str


ROWS: tuple[Row, ...] = (
    Row("bf16", (), "bf16", False, "bf16", "unquantized weights, bf16 KV cache"),
    Row("fp8", ("--fp8",), "fp8", False, "bf16", "--fp8: block 128x128 e4m3 weights, W8A8"),
    Row("kv-e4m3", ("--kv-cache-dtype", "fp8_e4m3"), "kv-e4m3", False, "bf16", "FP8 e4m3 KV cache, scales 1.0"),
    Row("kv-e4m3-cal", ("--kv-cache-dtype", "fp8_e4m3", "--calibration-text", CALIB), "kv-e4m3-cal", False,
        "bf16", "FP8 e4m3 KV cache, calibrated per-layer scales"),
    Row("kv-e5m2", ("--kv-cache-dtype", "fp8_e5m2"), "kv-e5m2", False, "bf16", "FP8 e5m2 KV cache, scales 1.0"),
    Row("kv-e5m2-cal", ("--kv-cache-dtype", "fp8_e5m2", "--calibration-text", CALIB), "kv-e5m2-cal", False,
        "bf16", "FP8 e5m2 KV cache, calibrated per-layer scales"),
    Row("bf16-cpu", (), "bf16", True, "bf16-cpu", "the bf16 artifact, 1 rank on CPU (tp2's reference)"),
    Row("tp2", ("--tp", "2"), "tp2", True, "bf16-cpu", "--tp 2: 2 ranks on CPU, gloo"),
)  # fmt: skip


class Log:
    """Progress lines on stderr, each with the seconds since the start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[train_eval {time.perf_counter() - self.start:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- the texts --------------------------------------------------------------------------------


def write_texts(out: Path, calib_bytes: int) -> dict[str, Any]:
    """held_out.txt (held-out split) and calibration.txt (train split) in `out`; what they hold."""
    train, held = train_data.split(train_data.stdlib_files())
    held_texts = train_data.read_texts(held, HELD_BYTES)
    calib_texts = train_data.read_texts(train[::CALIB_EVERY], calib_bytes)
    (out / "held_out.txt").write_text("\n".join(held_texts), encoding="utf-8")
    (out / "calibration.txt").write_text("\n".join(calib_texts), encoding="utf-8")
    return {"held_out_files": len(held_texts), "held_out_chars": sum(map(len, held_texts)),
            "calibration_files": len(calib_texts), "calibration_chars": sum(map(len, calib_texts)),
            "python": platform.python_version()}  # fmt: skip


def train_length(ckpt: Path) -> int:
    """The sequence length the checkpoint was trained on: YaRN's original_max_position_embeddings."""
    raw = json.loads((ckpt / "config.json").read_text())
    scaling = raw.get("rope_scaling") or {}
    return int(scaling.get("original_max_position_embeddings", raw["max_position_embeddings"]))


# ---- compile and eval, through the CLI ----------------------------------------------------------


def run_cli(args: list[str], log_path: Path) -> float:
    """`python -m mlac.cli ARGS`, output to log_path; its seconds. MlacError with the output's last
    lines when it fails."""
    start = time.perf_counter()
    with log_path.open("w") as f:
        cmd = [sys.executable, "-m", "mlac.cli", *args]  # cwd ROOT: this checkout's mlac
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise MlacError(f"mlac {args[0]} exited {rc}: " + " | ".join(tail))
    return time.perf_counter() - start


def compile_row(row: Row, ckpt: Path, out: Path, accuracy_check: bool, log: Log) -> float:
    """Compile row's artifact into out/art/<artifact> unless it exists; the seconds it took."""
    art = out / "art" / row.artifact
    if art.exists():
        return 0.0
    args = [str(out / "calibration.txt") if a == CALIB else a for a in row.compile_args]
    args += [] if accuracy_check else ["--skip-accuracy-check"]
    log(f"compile {row.artifact}: mlac compile {' '.join(args) or '(bf16)'}")
    return run_cli(["compile", str(ckpt), str(art), *args], out / "logs" / f"compile-{row.artifact}.txt")


def eval_row(row: Row, out: Path, device: str, dtype: str, max_tokens: int, context: int, log: Log) -> dict:
    """`mlac eval` of row's artifact over held_out.txt; its JSON record and seconds."""
    record = out / "eval" / f"{row.name}.json"
    log(f"eval {row.name}: {device} {dtype}, {max_tokens} tokens in windows of {context}")
    seconds = run_cli(["eval", str(out / "art" / row.artifact), "--text", str(out / "held_out.txt"),
                       "--device", device, "--dtype", dtype, "--max-tokens", str(max_tokens),
                       "--context-len", str(context), "--json", str(record)],
                      out / "logs" / f"eval-{row.name}.txt")  # fmt: skip
    result = json.loads(record.read_text())
    log(
        f"eval {row.name}: perplexity {result['perplexity']:.4f} over {result['tokens']} tokens ({seconds:.1f} s)"
    )
    return {**result, "eval_s": round(seconds, 2)}


# ---- top-1 agreement, in process -----------------------------------------------------------------


@torch.no_grad()
def argmaxes(art: Path, device: str, dtype: str, text: str, n_tokens: int, context: int) -> torch.Tensor:
    """The argmax [n] of each position the first n_tokens (non-overlapping windows of `context`)
    let `mlac eval` score, through Engine.score as `mlac eval` runs it."""
    from mlac.runtime.engine import perplexity as ppl
    from mlac.runtime.engine.engine import Engine
    from mlac.tools import evaluate as ev

    engine = Engine.from_artifact(art, device=device, dtype=getattr(torch, dtype), verify=False,
                                  num_blocks=-(-context // 16) + 1, cuda_graph=False)  # fmt: skip
    with engine:
        ids, _ = ev.encode_text(engine, text, n_tokens)
        chunk = engine.scheduler_config.chunked_prefill_size
        picks = []
        for w in ppl.windows(len(ids), context, context):
            logits = engine.score(ids[w.begin : w.end], chunk_size=chunk)  # [T, V]
            picks.append(logits[w.first - w.begin - 1 : -1].argmax(-1).cpu())
    return torch.cat(picks)


def add_top1(rows: list[dict], out: Path, n_tokens: dict[bool, int], context: int, log: Log) -> None:
    """rows[i]["top1_vs_reference"]: agreement of each measured row's argmax with its reference's."""
    text = (out / "held_out.txt").read_text(encoding="utf-8")
    picks: dict[str, torch.Tensor] = {}
    for r in rows:
        if "perplexity" not in r:
            continue
        start = time.perf_counter()
        try:
            picks[r["row"]] = argmaxes(out / "art" / r["artifact"], r["device_arg"], r["dtype"], text,
                                       n_tokens[r["on_cpu"]], context)  # fmt: skip
        except (MlacError, RuntimeError) as e:
            log(f"top-1 {r['row']}: failed ({e})")
            continue
        ref = picks.get(r["reference"])
        if ref is not None:
            r["top1_vs_reference"] = float((picks[r["row"]] == ref).double().mean())
            r["top1_tokens"] = ref.numel()
            log(f"top-1 {r['row']} vs {r['reference']}: {r['top1_vs_reference']:.4f} "
                f"({time.perf_counter() - start:.1f} s)")  # fmt: skip


# ---- the table --------------------------------------------------------------------------------


def measure_row(row: Row, ckpt: Path, out: Path, args: argparse.Namespace, context: int, log: Log) -> dict:
    """Compile and score one row; its record (with "error" instead of numbers when it failed)."""
    device, dtype = ("cpu", "float32") if row.on_cpu or args.device == "cpu" else (args.device, "bfloat16")
    tokens = args.cpu_max_tokens if row.on_cpu else args.max_tokens
    rec: dict[str, Any] = {"row": row.name, "what": row.what, "artifact": row.artifact, "reference": row.reference,
                           "on_cpu": row.on_cpu, "device_arg": device, "dtype": dtype,
                           "compile_args": list(row.compile_args)}  # fmt: skip
    try:
        rec["compile_s"] = round(compile_row(row, ckpt, out, args.accuracy_check, log), 2)
        ev = eval_row(row, out, device, dtype, tokens, context, log)
    except MlacError as e:
        log(f"{row.name}: FAILED: {e}")
        return {**rec, "error": str(e)}
    keep = (
        "perplexity",
        "tokens",
        "windows",
        "mean_nll",
        "bits_per_byte",
        "device",
        "quantization",
        "eval_s",
    )
    return {**rec, **{k: ev[k] for k in keep}, "accuracy": manifest_accuracy(out / "art" / row.artifact)}


def manifest_accuracy(art: Path) -> dict[str, Any]:
    """The compile's own accuracy report and KV scales, from the artifact's manifest."""
    from mlac.core.artifact import Manifest

    m = Manifest.load(art)
    return {**m.accuracy.model_dump(mode="json", exclude_none=True), "kv_scales": m.quantization.kv_scales}


def add_deltas(rows: list[dict]) -> None:
    """delta (absolute, %) of each row's perplexity against its reference row's."""
    by_name = {r["row"]: r for r in rows}
    for r in rows:
        ref = by_name.get(r["reference"], {})
        if "perplexity" in r and "perplexity" in ref:
            r["delta"] = r["perplexity"] - ref["perplexity"]
            r["delta_pct"] = 100.0 * r["delta"] / ref["perplexity"]


def versions() -> dict[str, Any]:
    git = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "gpu": gpu,
            "cpu_threads": torch.get_num_threads(), "mlac_commit": git.stdout.strip() or None}  # fmt: skip


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, fmt)


def markdown(table: dict[str, Any]) -> str:
    """table.md: one line per row, then how it was measured."""
    lines = [
        f"# Perplexity deltas of the trained checkpoint ({table['checkpoint']})", "",
        "| row | what | scored on | perplexity | Δ vs reference | Δ % | top-1 vs reference | compile s | eval s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in table["rows"]:
        where = f"{r['device_arg']} {r['dtype']}"
        if "error" in r:
            lines.append(f"| {r['row']} | {r['what']} | {where} | failed: {r['error'][:120]} | | | | | |")
            continue
        if r["reference"] == r["row"]:
            delta, pct = "reference", ""
        else:
            delta, pct = (
                f"{_num(r.get('delta'), '+.4f')} vs {r['reference']}",
                _num(r.get("delta_pct"), "+.3f"),
            )
        lines.append(
            f"| {r['row']} | {r['what']} | {where} | {r['perplexity']:.4f} | {delta} "
            f"| {pct} | {_num(r.get('top1_vs_reference'), '.4f')} "
            f"| {r.get('compile_s', 0):.1f} | {r['eval_s']:.1f} |"
        )
    t, v = table["texts"], table["versions"]
    lines += trained_lines(table.get("train_report"))
    lines += [
        "",
        f"Held-out text: {t['held_out_files']} stdlib files of the held-out split ({t['held_out_chars']:,} chars, "
        f"Python {t['python']}); scored in non-overlapping windows of {table['context_len']} tokens (the training "
        f"length): the first {table['max_tokens']:,} tokens on {table['device']}, the first "
        f"{table['cpu_max_tokens']:,} for the CPU pair. Calibration text: {t['calibration_files']} files of the "
        f"train split. Top-1 over the first {table['top1_tokens']:,} scored positions.",
        "",
        "The tp2 row runs its two ranks on CPU (gloo, float32): its delta is against bf16-cpu (the bf16 artifact, "
        "1 rank, CPU, float32, same tokens), not against the bf16 row. Every other row is scored on "
        f"{table['device']} in {'bfloat16' if table['device'] != 'cpu' else 'float32'}.",
        "",
        f"torch {v['torch']}, Python {v['python']}, GPU {v['gpu'] or 'none'}, mlac {v['mlac_commit']}; "
        f"{table['seconds']:.0f} s in all.",
    ]
    return "\n".join(lines) + "\n"


def trained_lines(report: dict[str, Any] | None) -> list[str]:
    """What train_small.py reported about the model (nothing without its train_report.json)."""
    if report is None:
        return []
    return [
        "",
        f"The model: {report['parameters']:,} parameters ({report['parameters_main']:,} without the MTP layer), "
        f"`{report['config']}` trained {report['steps']} steps ({report['tokens']:,} tokens) in {report['seconds']:.0f} s "
        f"on {report['device']}; held-out perplexity {report['held_out_perplexity']:.3f} (transformers, its own "
        f"windows) against {report['unigram_perplexity']:.1f} for a unigram model. Greedy continuation of "
        f"{report['greedy_prompt']!r}: {report['greedy_continuation']!r}.",
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the table for args.ckpt in args.out; returns it (also table.json and table.md)."""
    log = Log()
    ckpt, out = Path(args.ckpt).resolve(), Path(args.out).resolve()
    check_dirs(ckpt, out, args.device)
    for sub in ("art", "logs", "eval"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    texts = write_texts(out, args.calibration_bytes)
    context = train_length(ckpt)
    log(f"texts: {texts['held_out_files']} held-out files, {texts['calibration_files']} calibration files; "
        f"windows of {context} tokens")  # fmt: skip
    table = {"checkpoint": str(ckpt), "device": args.device, "context_len": context, "max_tokens": args.max_tokens,
             "cpu_max_tokens": args.cpu_max_tokens, "top1_tokens": args.top1_tokens, "texts": texts,
             "versions": versions(), "train_report": train_summary(ckpt), "rows": [], "seconds": 0.0}  # fmt: skip
    for row in ROWS:
        if not (row.on_cpu and args.no_tp2):
            table["rows"].append(measure_row(row, ckpt, out, args, context, log))
            write_table(table, out, log)  # after every row: a run cut short keeps what it measured
    add_top1(table["rows"], out, {False: min(args.top1_tokens, args.max_tokens), True: args.cpu_max_tokens},
             context, log)  # fmt: skip
    write_table(table, out, log)
    log(f"wrote {out / 'table.md'} and table.json")
    return table


def write_table(table: dict[str, Any], out: Path, log: Log) -> None:
    """table.json and table.md, with the deltas of the rows measured so far."""
    add_deltas(table["rows"])
    table["seconds"] = round(time.perf_counter() - log.start, 1)
    (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "table.md").write_text(markdown(table))


def train_summary(ckpt: Path) -> dict[str, Any] | None:
    """The checkpoint's train_report.json without its loss history (None when absent)."""
    path = ckpt / "train_report.json"
    if not path.is_file():
        return None
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "losses"}


def check_dirs(ckpt: Path, out: Path, device: str) -> None:
    if not (ckpt / "config.json").is_file():
        raise MlacError(f"{ckpt}: no config.json (make one with benchmarks/train/train_small.py)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlacError(f"{out}: exists and is not an empty directory; remove it or pick another")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MlacError("--device cuda: no CUDA device is available")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ckpt", help="checkpoint directory of benchmarks/train/train_small.py")
    p.add_argument("out", help="output directory (new or empty)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu: where the rows are scored")
    p.add_argument("--max-tokens", type=int, default=40_000, help="held-out tokens scored on --device")
    p.add_argument("--cpu-max-tokens", type=int, default=4096, help="held-out tokens of the CPU tp2 pair")
    p.add_argument("--top1-tokens", type=int, default=8192, help="positions of the top-1 agreement")
    p.add_argument("--no-tp2", action="store_true", help="leave out the CPU pair (bf16-cpu, tp2)")
    p.add_argument("--calibration-bytes", type=int, default=CALIB_BYTES, help="size of calibration.txt")
    p.add_argument("--accuracy-check", action="store_true",
                   help="keep compile's own accuracy check (probes; on the calibrated rows also 3 CPU passes "
                        "over the calibration text): the manifest's report, recorded per row")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.max_tokens, args.cpu_max_tokens, args.top1_tokens) < 2:
        p.error("--max-tokens, --cpu-max-tokens and --top1-tokens must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        table = run(parse_args(argv))
    except MlacError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if any("error" in r for r in table["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
