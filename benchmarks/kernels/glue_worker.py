"""The measuring side of inductor_glue.py, made in its worker process (worker_process.py): one row's
mlac piece, checked and timed, or its reference compiled in one mode, checked and timed. A CUDA error
is marked as a fault (FAULT): the process that met it ends, as its CUDA context is not to be trusted.
Not a benchmark itself.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import glue_pieces as gp  # noqa: E402
from timing import copy_gbps, graph_us  # noqa: E402

FAULT = "CUDA fault"
# What a CUDA error says, through the wrappers torch puts around it (InductorError, RuntimeError):
# after any of these the process's CUDA context is not to be trusted.
FAULT_WORDS = ("CUDA error", "CUDA driver error", "illegal memory access", "device-side assert")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall_us(fn, dev: torch.device, calls: int = 3) -> float:
    """Median wall microseconds of eager calls, each synchronized (CPU, and what runs outside graphs)."""
    fn()
    sync(dev)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def time_us(fn, dev: torch.device) -> float:
    """CUDA-graph replay median on CUDA; eager wall time on CPU (no graphs there)."""
    return graph_us([fn]) if dev.type == "cuda" else wall_us(fn, dev)


def call(case: gp.Case, fn, args: tuple):
    """One timed call: the case's `before` (fresh noise), then fn."""
    if case.before is not None:
        case.before(args)
    return fn(*args)


def compile_ref(case: gp.Case, args: tuple, mode: str, backend: str, dev: torch.device):
    """torch.compile of the reference, compiled by a first call on args -> (fn, its output, seconds)."""
    torch._dynamo.reset()  # each shape its own compile, never a recompile limit reached
    kw = {"mode": None if mode == "default" else mode} if backend == "inductor" else {}
    fn = torch.compile(case.ref, backend=backend, fullgraph=True, dynamic=False, **kw)
    start = time.perf_counter()
    out = fn(*args)
    sync(dev)
    return fn, out, time.perf_counter() - start


def warm_inductor(dev: torch.device, index: int) -> float:
    """Seconds of one throwaway compile: Inductor's start in this process, kept out of every piece's
    compile_s. `index` (the worker's) makes its graph new to the shared cache, so it pays in full."""
    x = torch.ones(8, device=dev)
    start = time.perf_counter()
    torch.compile(lambda a: a * 2 + index, fullgraph=True, dynamic=False)(x)
    sync(dev)
    torch._dynamo.reset()
    return round(time.perf_counter() - start, 2)


def failed(e: BaseException) -> dict:
    """The error's whole text; a CUDA error is marked FAULT (its process must end)."""
    text = f"{type(e).__name__}: {str(e).strip()}"
    if isinstance(e, getattr(torch, "AcceleratorError", ())) or any(w in text for w in FAULT_WORDS):
        return {"error": f"{FAULT}: {text}"}
    torch._dynamo.reset()
    return {"error": text}


def fraction(nbytes: int, us: float | None, bw: float | None) -> float | None:
    """The bandwidth floor of nbytes over the measured time (bw in GB/s: GB/s x 1e3 = bytes per us)."""
    return None if us is None or bw is None else round(nbytes / (bw * 1e3) / us, 3)


def run_mlac(case: gp.Case, dev: torch.device, bw: float | None) -> tuple[dict, list | None]:
    """mlac's piece: checked against the eager reference, timed -> (row fields, its outputs)."""
    row: dict = {}
    try:
        args = case.inputs()
        want = case.outputs(args, case.mlac(*args))
        ref_args = case.inputs()
        row["ref_max_error"] = gp.max_error(case, case.outputs(ref_args, case.ref(*ref_args)), want)
        row["ref_ok"] = row["ref_max_error"] <= case.tol
        timed = case.inputs()
        row["mlac_us"] = round(time_us(lambda: call(case, case.mlac, timed), dev), 2)
        row["mlac_fraction"] = fraction(case.nbytes, row["mlac_us"], bw)
        if case.checks is not None:
            row.update(case.checks())
        for name, fn in (case.eager or {}).items():
            row.setdefault("eager_us", {})[name] = round(wall_us(fn, dev), 2)
    except Exception as e:  # noqa: BLE001  (recorded in the row; the run goes on)
        return failed(e), None
    return row, want


def run_inductor(
    case: gp.Case, want: list, mode: str, backend: str, dev: torch.device, bw: float | None
) -> dict:
    """The compiled reference in `mode`: compiled, checked against mlac's outputs, timed."""
    try:
        args = case.inputs()
        fn, out, compile_s = compile_ref(case, args, mode, backend, dev)
        err = gp.max_error(case, case.outputs(args, out), want)
        timed = case.inputs()
        us = round(time_us(lambda: call(case, fn, timed), dev), 2)
    except Exception as e:  # noqa: BLE001
        return failed(e)
    finally:
        torch._dynamo.reset()
    return {"us": us, "compile_s": round(compile_s, 2), "max_error": err, "ok": err <= case.tol, "tol": case.tol,
            "fraction": fraction(case.nbytes, us, bw)}  # fmt: skip


class Worker:
    """The measuring side, made in the worker process (worker_process.py). Tasks name a row by its
    key (piece, model, batch): {"kind": "mlac", "row": key} -> mlac's fields ({"absent": True}: the
    model has no such piece); {"kind": "compile", "row": key, "mode": m} -> that mode's result. A
    result whose error is a FAULT ends the process."""

    def __init__(self, opts: dict, bw: float | None, index: int):
        self.opts, self.dev = opts, torch.device(opts["device"])
        self.configs = gp.model_configs(opts["smoke"])
        self.bw = copy_gbps() if bw is None and self.dev.type == "cuda" else bw
        with torch.no_grad():
            self.start_s = warm_inductor(self.dev, index) if opts["backend"] == "inductor" else None
        self.held = None  # (key, case, mlac's outputs) of the latest row measured
        self.poisoned = False

    def hello(self) -> dict:
        cuda = self.dev.type == "cuda"
        interp = not cuda and gp.forced(self.dev)
        return {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "copy_gb_per_s": self.bw and round(self.bw, 1), "inductor_start_s": self.start_s,
            "mlac_path": "Triton kernels" if cuda else ("Triton interpreter" if interp else "the wrappers' CPU references"),
        }  # fmt: skip

    def do(self, task: dict) -> tuple[dict, bool]:
        with torch.no_grad():
            result = self.mlac(tuple(task["row"])) if task["kind"] == "mlac" else self.compile(task)
        return result, result.get("error", "").startswith(FAULT)

    def mlac(self, key: tuple) -> dict:
        try:
            self.fault_point(key, compiling=False)
            case = gp.build(key[0], self.configs[key[1]], key[2], self.dev)
        except Exception as e:  # noqa: BLE001
            return failed(e)
        if case is None:
            return {"absent": True}
        fields, want = run_mlac(case, self.dev, self.bw)
        self.held = (key, case, want) if want is not None else None
        return {"shape": case.shape, "mlac": case.what, "bytes": case.nbytes, **fields}

    def compile(self, task: dict) -> dict:
        key = tuple(task["row"])
        try:
            self.fault_point(key, compiling=True)
            if self.held is None or self.held[0] != key:  # a later mode, or a fresh worker
                case = gp.build(key[0], self.configs[key[1]], key[2], self.dev)
                args = case.inputs()
                self.held = (key, case, case.outputs(args, case.mlac(*args)))
        except Exception as e:  # noqa: BLE001
            return failed(e)
        _, case, want = self.held
        return run_inductor(case, want, task["mode"], self.opts["backend"], self.dev, self.bw)

    def fault_point(self, key: tuple, compiling: bool) -> None:
        """The test hook --inject-fault ROW:KIND, at ROW's compile. raise: the error an illegal memory
        access gives, and from then on every task here raises it, as a poisoned CUDA context does;
        die: the process exits at once; hang: it answers nothing until its parent is gone."""
        fault = getattr(torch, "AcceleratorError", RuntimeError)
        if self.poisoned:
            raise fault("CUDA error: an illegal memory access was encountered (this process faulted before)")
        spec = self.opts["inject_fault"]
        if not compiling or spec is None or tuple(spec[0]) != key:
            return
        if spec[1] == "die":
            os._exit(70)
        if spec[1] == "hang":
            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(0.2)
            os._exit(0)
        self.poisoned = True
        raise fault("CUDA error: an illegal memory access was encountered (simulated: --inject-fault)")
