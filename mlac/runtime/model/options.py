"""ModelOptions: the choices between exact forms of one computation that the model makes once, when
it is built (the runner builds the model with RuntimeOptions.model)."""

from __future__ import annotations

from dataclasses import dataclass

from mlac.core.options import Options


@dataclass(frozen=True)
class ModelOptions(Options):
    """Which of two exact forms the model runs, where both exist; the model hands each kernel call
    the choice it needs. The defaults are what a server runs, each measured the faster where its
    rule takes it, and what the warm-up and `mlac prepare` meet; the other values let tests compare
    the forms (`Engine.from_artifact(path, shared_prefix=False)`). No flag or setting changes them.

    `shared_prefix`: sequences of an extend step that share cached blocks attend to them in one
    cascade launch where `prefer_shared` takes it (attention.extend_shared); off, each sequence
    attends to all of its tokens in the plain extend.
    `fused_mla_out`: the absorbed decode's last head_bmm merges the split-KV partials (up to
    attention.FUSED_MERGE_MAX_SPLITS splits) and, for an FP8 `wo`, writes wo's quantized input;
    off, the merge kernel and wo's act_quant run as launches of their own.
    `fp8_cublas`: FP8 linears run through cuBLAS's block-scaled GEMM at the rows and shapes where
    it was measured faster (kernels/gemm/fp8_cublas.py: from 32 rows), where this GPU, torch and
    compute dtype have it; off, mlac's Triton GEMM at every row count."""

    shared_prefix: bool = True
    fused_mla_out: bool = True
    fp8_cublas: bool = True


DEFAULTS = ModelOptions()  # what a server runs
