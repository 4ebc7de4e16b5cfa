"""How much lower a lone cached request's time to first token can be than a cold one's (no GPU needed).

A cold request prefills its whole prompt: compute, 2 FLOPs per active parameter per token plus the
causal attention. A cached one prefills its suffix only, but its MoE layers still read the experts
that the suffix's tokens route to: with S tokens of k experts each out of E, about
E·(1 - (1 - k/E)^S) per layer under uniform routing, every expert for S = 64 on V2-Lite. So at the
device's ceilings the cold step is bounded below by its FLOPs, the cached one by its bytes, and
their ratio by

    (cold FLOPs / matmul ceiling + serving) / (cached bytes / copy bandwidth + serving)

This script computes those floors from a model's config (a synth preset or a config.json) and the
ceilings measured on the device (DESIGN.md's H200 values by default). With `--cold-ms` (a measured
cold TTFT) it also gives the fraction of the matmul ceiling that cold prefill ran at, and the
largest fraction at which the cold TTFT is still `--target` times the cached floor.

    python benchmarks/e2e/prefix_bound.py --preset v2-lite --prefix 2000 --suffix 64 --serving-ms 2.5

Counts only the weights and the attention's dot products (norms, rope, routing and the LM head of
the prompt's last token are left out of both sides), so both floors are slightly low.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlac.core.config import ModelConfig
from mlac.synth.presets import PRESETS


def layer_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one layer's parts: attention, a dense MLP, one expert, the router."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = d * cfg.kv_latent_dim + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return {
        "attention": q + kv + h * cfg.v_head_dim * d,
        "dense_mlp": 3 * d * cfg.intermediate_size,
        "expert": 3 * d * cfg.moe_intermediate_size,
        "router": d * (cfg.n_routed_experts or 0),
    }


def bound(
    cfg: ModelConfig, prefix: int, suffix: int, gbs: float, tflops: float, serving_ms: float, bytes_per: int
) -> dict:
    p = layer_params(cfg)
    layers = range(cfg.num_hidden_layers)
    moe = [i for i in layers if cfg.is_moe_layer(i)]
    dense = len(layers) - len(moe)
    e, k, shared = cfg.n_routed_experts or 0, cfg.num_experts_per_tok, cfg.n_shared_experts
    touched = e * (1 - (1 - k / e) ** suffix) if e else 0.0  # experts a suffix reads, per MoE layer
    head = cfg.vocab_size * cfg.hidden_size  # the LM head (the embedding is a gather)
    stem = len(layers) * p["attention"] + dense * p["dense_mlp"] + head
    cached_bytes = bytes_per * (stem + len(moe) * ((touched + shared) * p["expert"] + p["router"]))
    active = (
        len(layers) * p["attention"]
        + dense * p["dense_mlp"]
        + len(moe) * ((k + shared) * p["expert"] + p["router"])
    )
    n = prefix + suffix
    h = cfg.num_attention_heads
    # causal attention, MHA form: QK (qk_head_dim) and PV (v_head_dim), 2 FLOPs each, n²/2 pairs
    attn = len(layers) * h * (cfg.qk_head_dim + cfg.v_head_dim) * n * n
    cold_flops = 2 * active * n + attn
    cached_ms = cached_bytes / (gbs * 1e9) * 1e3
    cold_ms = cold_flops / (tflops * 1e12) * 1e3
    return {
        "prefix": prefix, "suffix": suffix, "copy_gbs": gbs, "matmul_tflops": tflops, "serving_ms": serving_ms,
        "experts_touched_per_layer": round(touched, 2), "cached_step_gb": round(cached_bytes / 1e9, 2),
        "cached_floor_ms": round(cached_ms + serving_ms, 2), "cold_tflop": round(cold_flops / 1e12, 2),
        "cold_floor_ms": round(cold_ms + serving_ms, 2),
        "ratio_at_ceilings": round((cold_ms + serving_ms) / (cached_ms + serving_ms), 2),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--config", type=Path, help="a model's config.json")
    ap.add_argument("--prefix", type=int, default=2000, help="cached prompt tokens")
    ap.add_argument("--suffix", type=int, default=64, help="new prompt tokens of a cached request")
    ap.add_argument("--copy-gbs", type=float, default=4274.0, help="device-to-device copy, GB/s (DESIGN.md)")
    ap.add_argument("--matmul-tflops", type=float, default=680.0, help="bf16 matmul 8192³ (DESIGN.md)")
    ap.add_argument("--serving-ms", type=float, default=0.0, help="fixed serving cost on both sides")
    ap.add_argument("--bytes-per-param", type=int, default=2, help="2: bf16")
    ap.add_argument("--cold-ms", type=float, help="a measured cold TTFT (ms)")
    ap.add_argument("--target", type=float, default=5.0, help="the cold / cached ratio asked for")
    args = ap.parse_args()
    raw = PRESETS[args.preset] if args.preset else json.loads(args.config.read_text())
    cfg = ModelConfig.from_hf(dict(raw), source=args.preset or str(args.config))
    out = bound(
        cfg,
        args.prefix,
        args.suffix,
        args.copy_gbs,
        args.matmul_tflops,
        args.serving_ms,
        args.bytes_per_param,
    )
    flop_ms = out["cold_floor_ms"] - args.serving_ms  # the cold prefill at the matmul ceiling
    # cold >= target x cached: the cold prefill's largest fraction of the ceiling that still gives it
    out["target"] = args.target
    out["max_cold_fraction_for_target"] = round(
        flop_ms / (args.target * out["cached_floor_ms"] - args.serving_ms), 3
    )
    if args.cold_ms is not None:
        out["cold_ms_measured"] = args.cold_ms
        out["cold_fraction_measured"] = round(flop_ms / (args.cold_ms - args.serving_ms), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
