"""`mlac bench`: prefill and decode speed of an artifact, in process, against the bandwidth roofline.

For each batch size B: B prompts of `input_len` random token ids run through the engine's
continuous-batching scheduler with `output_len` tokens each (greedy, eos ignored). Prefill is timed
until every sequence has its first token; decode from there to the end. The roofline is the
fewest bytes a decode step must read (from the manifest: every rank-0 weight once, the routed
experts that B tokens are expected to touch, B sequences' cached latents) over the device-copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from mlac.core.artifact import Manifest
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4}
EXPERT_TENSORS = (".moe.w13", ".moe.w2")  # [E_local, ...] stacked routed experts (and their .scale)


@dataclass(frozen=True)
class BenchResult:
    batch: int
    input_len: int
    output_len: int
    prefill_s: float
    prefill_tokens_per_s: float
    decode_steps: int
    decode_s: float
    decode_tokens_per_s: float
    ms_per_step: float
    step_bytes: int  # the fewest bytes one decode step reads (rank 0)
    roofline_tokens_per_s: float
    roofline_fraction: float
    accept_length: float | None = None  # speculative decoding: tokens per sequence per verify step
    # speculative decoding: plain decoding's tok/s in the same run (same engine and overlap setting)
    plain_decode_tokens_per_s: float | None = None


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 27)
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def decode_step_bytes(manifest: Manifest, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """Bytes rank 0 must read in one decode step of `batch` sequences of `context` cached tokens:
    every weight once (the embedding only for the batch's rows), of the routed experts only those
    `batch` tokens are expected to pick (uniform routing: E·(1 − (1 − k/E)^B) per layer)."""
    cfg = manifest.model
    experts = cfg.n_routed_experts or 1
    touched = experts * (1 - (1 - (cfg.num_experts_per_tok or 1) / experts) ** batch)
    total = 0
    for name, t in manifest.tensors[0].items():
        size = ITEMSIZE[t.dtype]
        for d in t.shape:
            size *= d
        if name == "embed":
            size = size // t.shape[0] * batch
        elif any(k in name for k in EXPERT_TENSORS):
            size = size * min(1.0, touched / experts)
        total += int(size)
    return total + batch * context * kv_bytes_per_token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class BatchRun:
    prefill_s: float
    decode_s: float
    steps: int  # decode steps
    tokens: int  # tokens generated after each sequence's first
    accept_length: float | None  # speculative decoding's tokens per verify (None: not speculating)


def run_batch(
    engine: Engine,
    batch: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    plain: bool = False,
    sampling: Mapping[str, Any] | None = None,
) -> BatchRun:
    """Prefill and decode of one batch through a fresh scheduler (`plain`: without speculation),
    every sequence sampling as `sampling` says (SamplingParams fields; default greedy)."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **(sampling or {}))
    sched = engine.scheduler(replace(engine.scheduler_config, speculative_num_steps=0) if plain else None)
    seqs = [
        engine.new_sequence([rng.randrange(3, vocab) for _ in range(input_len)], params) for _ in range(batch)
    ]
    for s in seqs:
        sched.add(s)
    _sync(engine.device)
    start = time.perf_counter()
    try:
        while not all(s.output_ids for s in seqs):
            sched.step()
        _sync(engine.device)
        prefilled = time.perf_counter()
        calls = 0
        while sched.has_unfinished:
            sched.step()
            calls += 1
        _sync(engine.device)
    finally:
        sched.abort_all()
    tokens = sum(len(s.output_ids) - 1 for s in seqs)
    # decode forwards: a speculative step per call; else one per token after the first (with overlap
    # scheduling the last call only lands the step before it, so calls would count one too many)
    steps = calls if sched.spec is not None else max(len(s.output_ids) for s in seqs) - 1
    spec = sched.spec.stats.accept_length if sched.spec is not None else None
    return BatchRun(prefilled - start, time.perf_counter() - prefilled, steps, tokens, spec)


def bench(
    engine: Engine,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    progress: Callable[[str], None] = lambda _: None,
    sampling: Mapping[str, Any] | None = None,
) -> tuple[float, list[BenchResult]]:
    """(copy bandwidth bytes/s, one result per batch size). Each batch runs once untimed first, long
    enough for every step shape it meets (speculative: steps of K drafts, then the shorter ones at
    its end); a speculative run also times plain decoding of the batch, its baseline. `sampling`:
    how every sequence samples (SamplingParams fields: temperature, top_p, top_k; default greedy)."""
    manifest = engine.manifest
    bandwidth = copy_bandwidth(engine.device)
    kv_per_token = engine.cache.bytes_per_block(engine.config, 1, engine.cache.dtype, engine.cache.kv_dtype)
    k = engine.scheduler_config.speculative_num_steps
    results = []
    for b in batch_sizes:
        run_batch(
            engine, b, input_len, min(output_len, 4 + 3 * (k + 1)), seed=1, sampling=sampling
        )  # warm-up
        plain_tps = None
        if k:
            run_batch(engine, b, input_len, min(output_len, 4), seed=1, plain=True, sampling=sampling)
            p = run_batch(engine, b, input_len, output_len, plain=True, sampling=sampling)
            plain_tps = p.tokens / p.decode_s if p.steps else 0.0
        r = run_batch(engine, b, input_len, output_len, sampling=sampling)
        prefill_s, decode_s, steps = r.prefill_s, r.decode_s, r.steps
        step_bytes = decode_step_bytes(manifest, b, input_len + output_len // 2, kv_per_token)
        decode_tps = r.tokens / decode_s if steps else 0.0
        roofline = b * bandwidth / step_bytes
        results.append(BenchResult(
            batch=b, input_len=input_len, output_len=output_len, prefill_s=prefill_s,
            prefill_tokens_per_s=b * input_len / prefill_s, decode_steps=steps, decode_s=decode_s,
            decode_tokens_per_s=decode_tps, ms_per_step=1e3 * decode_s / max(steps, 1), step_bytes=step_bytes,
            roofline_tokens_per_s=roofline, roofline_fraction=decode_tps / roofline, accept_length=r.accept_length,
            plain_decode_tokens_per_s=plain_tps,
        ))  # fmt: skip
        spec = f", {r.accept_length:.2f} tokens per verify" if r.accept_length is not None else ""
        if plain_tps:
            spec += f", {decode_tps / plain_tps:.2f}x plain decoding's {plain_tps:,.0f} tok/s"
        progress(f"batch {b}: decode {decode_tps:,.0f} tok/s{spec}")
    return bandwidth, results


def table(bandwidth: float, results: list[BenchResult]) -> str:
    head = f"{'batch':>6} {'prefill tok/s':>14} {'decode tok/s':>13} {'ms/step':>8} {'roofline tok/s':>15} {'of roofline':>12}"
    rows = [
        f"{r.batch:>6} {r.prefill_tokens_per_s:>14,.0f} {r.decode_tokens_per_s:>13,.1f} {r.ms_per_step:>8.2f} "
        f"{r.roofline_tokens_per_s:>15,.0f} {r.roofline_fraction:>11.1%}"
        for r in results
    ]
    spec = [f"speculative: {r.accept_length:.2f} tokens per verify at batch {r.batch}" + (
                f"; plain decoding (same engine, same overlap setting) {r.plain_decode_tokens_per_s:,.1f} tok/s, "
                f"speed-up {r.decode_tokens_per_s / r.plain_decode_tokens_per_s:.2f}x"
                if r.plain_decode_tokens_per_s else "")
            for r in results if r.accept_length is not None]  # fmt: skip
    return "\n".join(
        [f"device copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)", head, *rows, *spec]
    )


def to_json(engine: Engine, bandwidth: float, results: list[BenchResult], **settings) -> str:
    device = engine.device
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": engine.config.model_type,
        "layers": engine.config.num_hidden_layers,
        "quantization": engine.manifest.quantization.scheme,
        "tp": engine.manifest.plan.tp,
        "copy_bandwidth_bytes_per_s": bandwidth,
        **settings,
        "results": [asdict(r) for r in results],
    }
    return json.dumps(record, indent=2)


def profile_decode(engine: Engine, batch: int, input_len: int, steps: int = 8) -> dict:
    """Kernel launches, graph replays, copies, GPU kernel time and wall time per decode step (torch
    profiler, CUDA only), over `steps` decode steps of `batch` sequences after their prefill. With
    speculative decoding a step is a speculative step (drafts, verify, refresh): `tokens_per_step`
    says what it yields, and wall minus GPU time bounds the host's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(2)
    k = engine.scheduler_config.speculative_num_steps
    params = SamplingParams(max_tokens=(steps + 2) * (k + 1), ignore_eos=True)  # no sequence ends inside
    vocab = engine.config.vocab_size
    sched = engine.scheduler()
    seqs = [
        engine.new_sequence([rng.randrange(3, vocab) for _ in range(input_len)], params) for _ in range(batch)
    ]
    for s in seqs:
        sched.add(s)
    try:
        while not all(s.output_ids for s in seqs):
            sched.step()
        sched.step()  # one decode step outside the profile
        _sync(engine.device)
        before = sum(len(s.output_ids) for s in seqs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                sched.step()
            _sync(engine.device)
            wall = time.perf_counter() - start
        tokens = sum(len(s.output_ids) for s in seqs) - before
    finally:
        sched.abort_all()
    return _profile_record(prof.events(), DeviceType, batch, steps, wall, tokens, k)


def _profile_record(events, device_type, batch: int, steps: int, wall: float, tokens: int, k: int) -> dict:
    gpu = [e for e in events if e.device_type == device_type.CUDA]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    replays = sum(1 for e in events if e.device_type == device_type.CPU and e.name == "cudaGraphLaunch")
    names: dict[str, list[float]] = {}  # name -> [launches, GPU µs]
    for e in kernels:
        n = names.setdefault(e.name[:100], [0, 0.0])
        n[0] += 1
        n[1] += e.device_time
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:25]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    busy_ms = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / steps
    return {
        "batch": batch,
        "steps": steps,
        "speculative_num_steps": k,
        "tokens_per_step": tokens / steps,  # over the batch
        "kernels_per_step": len(kernels) / steps,
        "graph_replays_per_step": replays / steps,
        "copies_per_step": (len(gpu) - len(kernels)) / steps,
        # the sum of the kernels' times; with PDL each kernel's time includes its wait for the one
        # before (they overlap), so this overstates the GPU's work: gpu_busy_ms_per_step does not
        "gpu_kernel_ms_per_step": gpu_ms,
        "gpu_busy_ms_per_step": busy_ms,  # time during which at least one kernel ran
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_idle_ms_per_step": max(0.0, 1e3 * wall / steps - busy_ms),  # the host's share, at most
        "kernels_by_gpu_time": [
            {"name": n, "launches_per_step": c / steps, "gpu_us_per_step": us / steps} for n, (c, us) in top
        ],
    }


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) spans: time during which at least one ran."""
    total, start, end = 0.0, None, None
    for s, e in sorted(spans):
        if end is None or s > end:  # a gap: close the run so far
            total += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (0.0 if end is None else end - start)


def profile_line(prof: dict) -> str:
    """One line of `profile_decode`'s record for the terminal."""
    kind = (
        f"speculative step (K = {prof['speculative_num_steps']})"
        if prof["speculative_num_steps"]
        else "decode step"
    )
    return (
        f"profile, batch {prof['batch']}, per {kind}: {prof['kernels_per_step']:.0f} kernels, "
        f"{prof['graph_replays_per_step']:.1f} graph replays, {prof['copies_per_step']:.1f} copies, "
        f"{prof['gpu_busy_ms_per_step']:.3f} ms GPU busy (kernel times summed {prof['gpu_kernel_ms_per_step']:.3f}) "
        f"of {prof['wall_ms_per_step']:.3f} ms wall, "
        f"{prof['tokens_per_step']:.2f} tokens"
    )
