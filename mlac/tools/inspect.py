"""`mlac inspect`: an artifact's manifest, identity, provenance, kernel-cache units and signature,
as text or (--json) as the manifest with those added."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from mlac.core.artifact import (
    IDENTITY,
    AccuracyReport,
    BucketPlan,
    Manifest,
    artifact_identity,
    recorded_identity,
)
from mlac.core.signing import SIGNATURE, UNIT_SIGNATURE, Signed, signer_hint
from mlac.core.units import KernelCache, UnitManifest, load_unit
from mlac.core.validity import unit_folders


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _buckets(b: BucketPlan | None) -> list[str]:
    """The CUDA-graph buckets and the memory plan, binary units (as GPU memory is reported)."""
    if b is None:
        return ["buckets       none (compiled before the buckets pass)"]
    sizes = b.decode_batch_sizes
    shown = ", ".join(map(str, sizes if len(sizes) <= 8 else [*sizes[:5], "...", sizes[-1]]))
    peaks = f"bs {sizes[0]}: {_gib(b.activation_bytes[0])}, bs {sizes[-1]}: {_gib(b.activation_bytes[-1])}"
    return [
        f"buckets       {len(sizes)} decode batch sizes: {shown} (--cuda-graph-max-bs {b.cuda_graph_max_bs})",
        f"memory plan   weights per rank: {', '.join(_gib(w) for w in b.weight_bytes)}",
        f"memory plan   KV cache {b.kv_bytes_per_token:,} bytes/token per rank; "
        f"CUDA-graph pool {_gib(b.graph_pool_bytes)}",
        f"memory plan   decode activations {peaks}; prefill of {b.prefill_tokens} tokens "
        f"{_gib(b.prefill_activation_bytes)} (estimates, x{b.safety_factor:g} safety factor)",
    ]  # fmt: skip


def _caches(caches: list[KernelCache]) -> list[str]:
    """The GPU targets the artifact holds kernel caches for (`mlac prepare`)."""
    if not caches:
        return ["kernel caches none (portable: kernels compile on first use; `mlac prepare` adds them)"]
    return [
        f"kernel cache  {c.key}: {c.signature.gpu_name}, sm {c.signature.compute_capability}, CUDA {c.signature.cuda}, "
        f"driver {c.signature.driver}, torch {c.signature.torch}, triton {c.signature.triton}; "
        f"{c.files} files, {_gb(c.bytes)}"
        for c in caches
    ]


def units(root: Path) -> dict[str, UnitManifest]:
    """The kernel-cache units beside the artifact (their files are checked by `verify`)."""
    return {key: load_unit(folder) for key, folder in unit_folders(root).items()}


def _units(root: Path, held: dict[str, UnitManifest]) -> list[str]:
    lines = []
    for key, u in held.items():
        s = u.signature
        signed = " signed" if (root / "cache" / key / UNIT_SIGNATURE).is_file() else ""
        lines.append(
            f"kernel cache  {key}: {s.gpu_name}, sm {s.compute_capability}, CUDA {s.cuda}, driver {s.driver}, "
            f"torch {s.torch}, triton {s.triton}; {len(u.files)} files, {_gb(u.bytes)}{signed} (unit)"
        )
    return lines


def _provenance(m: Manifest) -> list[str]:
    p = m.provenance
    if p is None:
        return ["provenance    none (compiled before manifests recorded it)"]
    origin = f"{p.repo or 'unknown repository'} @ {p.revision or 'unknown revision'}"
    tools = ", ".join(f"{k} {v}" for k, v in sorted(p.tools.items()))
    size = sum(f.size for f in p.files)
    return [
        f"provenance    {origin}; {len(p.files)} source files, {_gb(size)} hashed",
        f"compiled by   {tools}",
    ]


def _signature(root: Path) -> str:
    hint = signer_hint(Signed(root, {}, SIGNATURE)) if (root / SIGNATURE).is_file() else None
    if hint is None:
        return "signature     none (`mlac sign` adds one)"
    return f"signature     {SIGNATURE}, key sha256 {hint[:16]}... (`mlac verify --public-key` checks it)"


def to_json(root: str | Path, m: Manifest) -> str:
    """The manifest, with the identity, the units beside it and the signature's key added."""
    root = Path(root)
    held = units(root)
    record = m.model_dump(mode="json") | {
        "identity": artifact_identity(root),
        "units": [
            {"key": k, "signature": u.signature.model_dump(mode="json"), "files": len(u.files), "bytes": u.bytes,
             "base_identity": u.base_identity, "signed": (root / "cache" / k / UNIT_SIGNATURE).is_file()}
            for k, u in held.items()
        ],
        "signature": {"file": SIGNATURE, "key_sha256": signer_hint(Signed(root, {}, SIGNATURE))}
        if (root / SIGNATURE).is_file() else None,
    }  # fmt: skip
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def describe_identity(root: str | Path) -> str:
    """The identity line: the manifest's sha256, and whether manifest.sha256 records the same
    (inspect shows a damaged artifact; `verify` and the loader refuse it)."""
    identity, recorded = artifact_identity(root), recorded_identity(root)
    note = ""
    if recorded is None:
        note = f" (no {IDENTITY}: unfinished, or older than identities; verify and load refuse it)"
    elif recorded != identity:
        note = f" (MISMATCH: {IDENTITY} says {recorded}; the manifest was edited)"
    return f"identity      {identity}{note}\n"


def _kv_scales(m: Manifest) -> str:
    """How an FP8 KV cache is scaled: calibrated per layer (min..max), or 1.0."""
    q, c = m.quantization, m.quantization.kv_calibration
    if m.options.kv_cache_dtype == "bf16":
        return ""
    if q.kv_scales is None:
        return ", scale 1.0 (uncalibrated)"
    on = f", calibrated on {c.tokens} tokens" if c is not None else ""
    return f", per-layer scales {min(q.kv_scales):.3e}..{max(q.kv_scales):.3e}{on}"


def describe(m: Manifest, root: str | Path | None = None) -> str:
    cfg = m.model
    routing = "dense"
    if cfg.n_routed_experts:
        routing = (f"{cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok}, {cfg.topk_method}/{cfg.scoring_func}, "
                   f"{cfg.n_shared_experts} shared")  # fmt: skip
    lines = [
        f"model         {cfg.model_type}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}",
        f"attention     MLA q_lora={cfg.q_lora_rank} kv_lora={cfg.kv_lora_rank} nope={cfg.qk_nope_head_dim} "
        f"rope={cfg.qk_rope_head_dim} v={cfg.v_head_dim}" + (f", YaRN x{cfg.rope_scaling.factor:g}" if cfg.rope_scaling else ""),
        f"moe           {routing}",
        f"source        {m.source.files} file(s), {_gb(m.source.bytes)}, dtypes {', '.join(m.source.dtypes)}"
        + (f", MTP layers {m.source.mtp_layers}" if m.source.mtp_layers else ""),
        f"mtp           {_mtp(m)}",
        f"passes        {' -> '.join(p.name for p in m.passes)}",
        f"plan          tp={m.plan.tp} ep={m.plan.ep} target={m.target}",
        f"quantization  {m.quantization.scheme}"
        + (f" ({m.quantization.fmt}, {m.quantization.block[0]}x{m.quantization.block[1]} blocks, "
           f"{m.quantization.tensors} tensors{', source blocks kept' if m.quantization.kept_source_blocks else ''})"
           if m.quantization.scheme != "none" else ""),
        f"kv cache      {m.options.kv_cache_dtype}" + _kv_scales(m),
        f"versions      mlac {m.mlac_version}, torch {m.torch_version}, triton {m.triton_version}",
    ]  # fmt: skip
    lines += _provenance(m)
    lines += _buckets(m.buckets)
    held = units(Path(root)) if root is not None else {}
    lines += _caches(m.caches) if m.caches or not held else []
    lines += _units(Path(root), held) if root is not None else []
    if root is not None:
        lines.append(_signature(Path(root)))
    sizes: dict[str, int] = defaultdict(int)
    for f in m.files:
        sizes[f.path.split("/")[0]] += f.size
    for part, size in sorted(sizes.items()):
        lines.append(f"size          {part}: {_gb(size)}")
    lines.append(f"size          total: {_gb(sum(sizes.values()))} in {len(m.files)} files")
    a = m.accuracy
    if a.status == "measured":
        lines.append(f"accuracy      vs {a.reference}, {a.probes}x{a.tokens_per_probe} tokens: rel_l2={a.rel_l2:.3e} "
                     f"max_abs={a.max_abs:.3e} top1={a.top1_agreement:.4f}")  # fmt: skip
    else:
        lines.append(f"accuracy      skipped: {a.reason}")
    lines += _text_accuracy(a)
    return "\n".join(lines) + "\n"


def _mtp(m: Manifest) -> str:
    """What the artifact holds of the source's MTP (NextN) layers: the speculative-decoding draft."""
    if m.mtp is None:
        return "left out (--no-mtp)" if m.source.mtp_layers else "none (the source has no MTP layer)"
    shared = [what for what, yes in (("embed", m.mtp.shared_embed), ("head", m.mtp.shared_head)) if yes]
    return (f"{', '.join(m.mtp.prefixes)} from source layer(s) {m.mtp.source_layers}, {m.mtp.tensors} tensors"
            + (f", {' and '.join(shared)} shared with the main model" if shared else ""))  # fmt: skip


def _text_accuracy(a: AccuracyReport) -> list[str]:
    """The perplexity lines of a report measured on calibration text (none without)."""
    if a.source_perplexity is None or a.artifact_perplexity is None:
        return []
    lines = [
        f"perplexity    source {a.source_perplexity:.4f}, artifact {a.artifact_perplexity:.4f} "
        f"({a.artifact_perplexity - a.source_perplexity:+.4f}) over {a.text_tokens} calibration tokens, "
        f"windows of {a.text_window}",
        f"top-1         {a.text_top1_agreement:.4f} agreement with the source over the calibration text",
    ]
    if a.kv_fp8_perplexity_cost is not None:
        lines.append(f"kv fp8 cost   {a.kv_fp8_perplexity_cost:+.4f} perplexity (vs an unquantized KV cache)")
    return lines
