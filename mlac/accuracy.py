"""Accuracy report: a compiled artifact against the unquantized source, on probe sequences.

Both sides run through mlac's CPU runtime in float32 (the runtime itself is checked against
transformers by the test suite): the reference is the same checkpoint compiled in memory
without FP8 (an FP8 source dequantized), 1 rank; the candidate is the artifact just written,
run with all its ranks and its KV-cache dtype. The error is what the artifact's options (FP8
weights and W8A8 activations, an FP8 KV cache, the per-rank split) cost.

This module sits above the runtime and beside the compiler: the compiler calls it with a way to
build the reference tensors, so it imports nothing from `mlac.compiler`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from mlac.artifact import AccuracyReport, Manifest

Reference = Callable[[], dict[str, torch.Tensor]]  # the 1-rank tensors compiled without FP8

PROBES = 4
PROBE_TOKENS = 32
PROBE_SEED = 1234
MEMORY_FRACTION = 0.6  # of available RAM that the check may use


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def needed_memory(params: int) -> int:
    """Two float32 copies of a model of `params` elements (reference and artifact) plus headroom."""
    return int(2 * 4 * params * 1.2)


def probe_tokens(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROBE_SEED)
    return [torch.randint(0, vocab, (PROBE_TOKENS,), generator=g).tolist() for _ in range(PROBES)]


def measure_accuracy(
    root: Path, manifest: Manifest, reference_tensors: Reference, params: int, log: Callable[[str], None]
) -> AccuracyReport:
    """Run the artifact being written at `root` (its files complete, `manifest` provisional)
    against `reference_tensors()`, or say why it was skipped: its options turn the check off, or
    the model (`params` source elements) does not fit this machine's memory twice in float32."""
    cfg = manifest.model
    if not manifest.options.accuracy_check:
        return AccuracyReport(status="skipped", reason="--skip-accuracy-check")
    need, have = needed_memory(params), available_memory()
    if need > MEMORY_FRACTION * have:
        reason = f"the model does not fit this machine for the check (needs ~{need / 1e9:.1f} GB, {have / 1e9:.1f} GB available)"
        log(f"accuracy: skipped: {reason}")
        return AccuracyReport(status="skipped", reason=reason)
    from mlac.runtime.engine import Engine  # here: a compile that skips the check never loads it

    log(f"accuracy: {PROBES} probes of {PROBE_TOKENS} tokens, artifact vs unquantized source (float32, CPU)")
    (root / "manifest.json").write_text(manifest.to_json())  # provisional; replaced at commit
    blocks = PROBES * (PROBE_TOKENS // 16 + 2)
    ref_tensors = reference_tensors()
    reference = Engine.from_tensors(cfg, ref_tensors, dtype=torch.float32, num_blocks=blocks)
    del ref_tensors
    want = [reference.score(ids) for ids in probe_tokens(cfg.vocab_size)]
    del reference
    # a multi-rank artifact runs as it will be served: one process per rank (gloo on CPU)
    with Engine.from_artifact(root, dtype=torch.float32, verify=False, num_blocks=blocks) as candidate:
        got = [candidate.score(ids) for ids in probe_tokens(cfg.vocab_size)]
    return compare_logits(torch.cat(got), torch.cat(want), reference="source compiled without fp8 (float32)")


def compare_logits(got: torch.Tensor, want: torch.Tensor, reference: str) -> AccuracyReport:
    """Logits [N, V] of the artifact against the reference."""
    got, want = got.double(), want.double()
    return AccuracyReport(
        status="measured",
        reference=reference,
        probes=PROBES,
        tokens_per_probe=PROBE_TOKENS,
        rel_l2=float((got - want).norm() / want.norm()),
        max_abs=float((got - want).abs().max()),
        top1_agreement=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
    )
