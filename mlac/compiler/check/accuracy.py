"""Accuracy report: a compiled artifact against the unquantized source, on probe sequences.

Both sides run through mlac's CPU runtime in float32 (the runtime itself is checked against
transformers by the test suite): the reference is the same checkpoint compiled in memory
without FP8 (an FP8 source dequantized), 1 rank; the candidate is the artifact just written,
run with all its ranks and its KV-cache dtype. The error is what the artifact's options (FP8
weights and W8A8 activations, an FP8 KV cache, the per-rank split) cost.

With calibration text (`compile --calibration-text`), both sides also score that text's tokens
(calibrate.text_tokens: the tokens the KV scales are calibrated on) through mlac.tools.evaluate.perplexity,
in non-overlapping windows of calibrate.WINDOW tokens: the source's and the artifact's perplexity,
and top-1 agreement over every position of the text. With an FP8 KV cache, the artifact's weights
(compiled in memory on 1 rank) score it once more with an unquantized cache, and

    kv_fp8_perplexity_cost = artifact_perplexity - perplexity with the unquantized cache

(for a multi-rank artifact this also holds the split's float32 rounding, orders below FP8's).

This module sits above the runtime and beside the compiler: the compiler calls it with a way to
build the reference tensors, so it imports nothing from `mlac.compiler`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mlac.compiler.check import calibrate
from mlac.core.artifact import AccuracyReport, Manifest
from mlac.core.errors import MlacError

if TYPE_CHECKING:
    from mlac.runtime.engine.engine import Engine

Reference = Callable[[], dict[str, torch.Tensor]]  # the 1-rank tensors compiled without FP8

PROBES = 4
PROBE_TOKENS = 32
PROBE_SEED = 1234
MEMORY_FRACTION = 0.6  # of available RAM that the check may use


@dataclass(frozen=True)
class TextCheck:
    """What the check scores besides the probes (with calibration text): the text's tokens, and a
    way to build the artifact's own tensors on 1 rank (for its unquantized-KV-cache perplexity)."""

    tokens: list[int]
    artifact_tensors: Reference


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
    root: Path,
    manifest: Manifest,
    reference_tensors: Reference,
    params: int,
    log: Callable[[str], None],
    text: TextCheck | None = None,
) -> AccuracyReport:
    """Run the artifact being written at `root` (its files complete, `manifest` provisional)
    against `reference_tensors()`, on the probes and, when given, on `text` (the text fields of the
    report; None without it); or say why it was skipped: its options turn the check off, or the
    model (`params` source elements) does not fit this machine's memory twice in float32."""
    cfg = manifest.model
    if not manifest.options.accuracy_check:
        return AccuracyReport(status="skipped", reason="--skip-accuracy-check")
    need, have = needed_memory(params), available_memory()
    if need > MEMORY_FRACTION * have:
        reason = f"the model does not fit this machine for the check (needs ~{need / 1e9:.1f} GB, {have / 1e9:.1f} GB available)"
        log(f"accuracy: skipped: {reason}")
        return AccuracyReport(status="skipped", reason=reason)
    from mlac.runtime.engine.engine import Engine  # here: a compile that skips the check never loads it

    log(f"accuracy: {PROBES} probes of {PROBE_TOKENS} tokens, artifact vs unquantized source (float32, CPU)")
    if text is not None:
        log(f"accuracy: and perplexity over {len(text.tokens)} calibration tokens")
    (root / "manifest.json").write_text(manifest.to_json())  # provisional; replaced at commit
    window = text_window(cfg.max_position_embeddings)
    blocks = max(PROBES * (PROBE_TOKENS // 16 + 2), -(-window // 16) + 1)
    ref_tensors = reference_tensors()
    reference = Engine.from_tensors(cfg, ref_tensors, dtype=torch.float32, num_blocks=blocks)
    del ref_tensors
    want, want_text = score_all(reference, cfg.vocab_size, text, window)
    del reference
    # a multi-rank artifact runs as it will be served: one process per rank (gloo on CPU)
    with Engine.from_artifact(root, dtype=torch.float32, verify=False, num_blocks=blocks) as candidate:
        got, got_text = score_all(candidate, cfg.vocab_size, text, window)
    report = compare_logits(
        torch.cat(got), torch.cat(want), reference="source compiled without fp8 (float32)"
    )
    if text is None or got_text is None or want_text is None:
        return report
    kv_cost = None
    if manifest.options.kv_cache_dtype in calibrate.FP8_KV_DTYPES:
        unquantized = Engine.from_tensors(
            cfg, text.artifact_tensors(), dtype=torch.float32, num_blocks=blocks
        )
        kv_cost = got_text[0] - text_score(unquantized, text.tokens, window)[0]
    fields = text_fields(want_text, got_text, window, kv_cost)
    log(
        f"accuracy: perplexity source {fields['source_perplexity']:.4f}, artifact {fields['artifact_perplexity']:.4f}"
    )
    return report.model_copy(update=fields)


def text_window(max_position_embeddings: int) -> int:
    """Tokens per perplexity window: calibrate.WINDOW, capped by the model's context."""
    return min(calibrate.WINDOW, max_position_embeddings)


TextScore = tuple[float, torch.Tensor, int]  # (perplexity, argmax of every position [T], tokens scored)


def score_all(
    engine: Engine, vocab: int, text: TextCheck | None, window: int
) -> tuple[list[torch.Tensor], TextScore | None]:
    """The probes' logits (each [PROBE_TOKENS, V]) and, with `text`, its score under `engine`."""
    probes = [engine.score(ids) for ids in probe_tokens(vocab)]
    return probes, (text_score(engine, text.tokens, window) if text is not None else None)


class Top1Recorder:
    """`engine` as mlac.tools.evaluate.perplexity uses it, keeping the argmax of every window's logits:
    one pass over the text gives both the perplexity and the top-1 predictions."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.max_context = engine.max_context
        self.scheduler_config = engine.scheduler_config
        self.top1: list[torch.Tensor] = []  # per window, [T]

    def score(self, token_ids: Sequence[int] | torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        logits = self.engine.score(token_ids, chunk_size=chunk_size)  # [T, V]
        self.top1.append(logits.argmax(-1))
        return logits


def text_score(engine: Engine, tokens: list[int], window: int) -> TextScore:
    """Perplexity of `tokens` under `engine` (mlac.tools.evaluate.perplexity, windows of `window`)."""
    from mlac.runtime.engine.perplexity import perplexity

    recorder = Top1Recorder(engine)
    result = perplexity(recorder, tokens, window)  # type: ignore[arg-type]
    return result.perplexity, torch.cat(recorder.top1), result.tokens


def text_fields(want: TextScore, got: TextScore, window: int, kv_cost: float | None) -> dict:
    """The report's text fields: reference `want` against artifact `got` (same windows)."""
    return {
        "text_tokens": want[2],
        "text_window": window,
        "source_perplexity": want[0],
        "artifact_perplexity": got[0],
        "text_top1_agreement": float((got[1] == want[1]).double().mean()),
        "kv_fp8_perplexity_cost": kv_cost,
    }


def compare_logits(got: torch.Tensor, want: torch.Tensor, reference: str) -> AccuracyReport:
    """Logits [N, V] of the artifact against the reference. MlacError when either holds NaN or inf:
    such a model is broken, and no agreement measured on it means anything."""
    got, want = got.double(), want.double()
    for what, t in (("the compiled artifact", got), (reference, want)):
        if not torch.isfinite(t).all():
            raise MlacError(
                f"accuracy check: {what} gives NaN or inf logits on the probe sequences; refusing the artifact"
            )
    return AccuracyReport(
        status="measured",
        reference=reference,
        probes=PROBES,
        tokens_per_probe=PROBE_TOKENS,
        rel_l2=float((got - want).norm() / want.norm()),
        max_abs=float((got - want).abs().max()),
        top1_agreement=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
    )
