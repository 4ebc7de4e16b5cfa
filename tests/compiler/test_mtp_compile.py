"""MTP (NextN) layers in the compiler: compiled by default under `mtp.{k}.`, left out with --no-mtp,
the embedding and head shared when the source's copies equal the main ones, and the compiled
layer's logits equal those of the reference MTP module (benchmarks/train/train_small.py's MTPLayer,
transformers' decoder block) that wrote the checkpoint.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _paths import REPO

from mlac.compiler.pipeline import compile_checkpoint, compile_tensors
from mlac.core.artifact import CompileOptions, Manifest
from mlac.core.errors import MlacError
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.layers import Weights
from mlac.runtime.model.model import DeepseekModel
from mlac.synth.train_export import write_checkpoint
from mlac.tools.inspect import describe

SCRIPT = REPO / "benchmarks" / "train" / "train_small.py"


def _train_small():
    spec = importlib.util.spec_from_file_location("train_small", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_v3_compiles_its_mtp_layer_with_shared_embed_and_head(artifact):
    m = Manifest.load(artifact("tiny-v3"))
    assert m.source.mtp_layers == [m.model.num_hidden_layers]
    assert m.mtp is not None and m.mtp.prefixes == ["mtp.0"] and m.mtp.shared_embed and m.mtp.shared_head
    names = set(m.tensors[0])
    for name in ("mtp.0.enorm", "mtp.0.hnorm", "mtp.0.eh_proj", "mtp.0.norm", "mtp.0.attn.w_kc",
                 "mtp.0.attn.w_qkv_a", "mtp.0.moe.w13", "mtp.0.attn_norm"):  # fmt: skip
        assert name in names, name
    assert not {"mtp.0.embed", "mtp.0.head"} & names  # shared: no duplicate bytes
    assert m.mtp.tensors == sum(1 for n in names if n.startswith("mtp."))
    assert "mtp           mtp.0 from source layer(s) [3]" in describe(m)


def test_fp8_tp2_mtp_is_quantized_and_sharded(checkpoint):
    ranks = compile_tensors(checkpoint("tiny-v3"), CompileOptions(fp8=True, tp=2))
    full = compile_tensors(checkpoint("tiny-v3"), CompileOptions())[0]
    for r in ranks:
        assert r["mtp.0.eh_proj"].dtype == torch.float8_e4m3fn and "mtp.0.eh_proj.scale" in r
        assert r["mtp.0.attn.w_kc"].shape[0] * 2 == full["mtp.0.attn.w_kc"].shape[0]  # heads split
        assert r["mtp.0.enorm"].shape == full["mtp.0.enorm"].shape  # replicated


def test_no_mtp_leaves_it_out(checkpoint, tmp_path):
    m = compile_checkpoint(checkpoint("tiny-v3"), tmp_path / "a", CompileOptions(mtp=False))
    assert m.mtp is None and not any(n.startswith("mtp.") for n in m.tensors[0])
    assert "left out (--no-mtp)" in describe(m)


def test_mtp_copies_that_differ_are_stored_vocab_parallel(tmp_path):
    ts = _train_small()
    raw = ts.RECIPES["micro"].model
    tensors = _reference(ts, raw).hf_tensors()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, raw, tensors, fp8=False)
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    hf = load_file(str(path))
    n = raw["num_hidden_layers"]
    hf[f"model.layers.{n}.shared_head.head.weight"] = hf["lm_head.weight"] * 2
    save_file(hf, str(path), metadata={"format": "pt"})
    ranks = compile_tensors(ckpt, CompileOptions(tp=2))
    assert "mtp.0.embed" not in ranks[0] and ranks[0]["mtp.0.head"].shape[0] == raw["vocab_size"] // 2
    one = compile_tensors(ckpt, CompileOptions())[0]
    model = DeepseekModel(_config(ckpt), Weights(one))  # takes mtp.0.head, shares the embedding
    assert model.mtp[0].head is not model.head and model.mtp[0].embed is model.embed


def _config(ckpt: Path):
    from mlac.core.config import ModelConfig

    return ModelConfig.from_dir(ckpt)


def _reference(ts, raw: dict):
    """train_small's Trainee (transformers' V3 and its MTPLayer), seeded, weights rounded to bf16
    (as the checkpoint stores them), in float32."""
    torch.manual_seed(0)
    model = ts.Trainee(raw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float() * 5)  # * 5: weights far from the init's near-zero outputs
    return model


def test_compiled_mtp_logits_equal_the_reference_module(tmp_path):
    ts = _train_small()
    raw = ts.RECIPES["micro"].model
    ref = _reference(ts, raw)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, raw, ref.hf_tensors(), fp8=False)
    with torch.no_grad():
        for p in ref.parameters():  # the checkpoint holds them in bf16
            p.copy_(p.bfloat16().float())
    tensors = compile_tensors(ckpt, CompileOptions())[0]
    cfg = _config(ckpt)
    model = DeepseekModel(
        cfg, Weights({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
    )
    x = torch.randint(0, raw["vocab_size"], (1, 18))
    inputs, nxt = x[0, :-1], x[0, 1:]  # T = 17: h_p and t_{p+1}
    cache = PagedKVCache(cfg, 4, 16, torch.float32, extra_layers=1)
    batch = ForwardBatch.build([0], [len(inputs)], [[0, 1]], 16)
    h = model(inputs, batch, cache)
    got = model.mtp[0].head(model.draft(h, nxt, batch, cache)).float()  # [T, V]
    with torch.no_grad():
        h_ref = ref.lm.model(input_ids=inputs[None]).last_hidden_state
        pos = torch.arange(len(inputs))[None]
        g = ref.mtp(
            h_ref, ref.lm.model.embed_tokens(nxt[None]), ref.lm.model.rotary_emb(h_ref, position_ids=pos)
        )
        want = ref.lm.lm_head(g)[0]
    assert ((h - h_ref[0]).norm() / h_ref.norm()).item() < 1e-4
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_incomplete_mtp_layer_is_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoint("tiny-v3")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (ckpt / f.name).write_bytes(f.read_bytes())
    files = sorted(src.glob("*.safetensors"))
    assert len(files) == 1, files
    hf = load_file(str(files[0]))
    del hf["model.layers.3.enorm.weight"]
    save_file(hf, str(ckpt / files[0].name), metadata={"format": "pt"})
    with pytest.raises(MlacError, match="missing tensor 'model.layers.3.enorm.weight'"):
        compile_tensors(ckpt, CompileOptions())
    assert compile_tensors(ckpt, CompileOptions(mtp=False))[0]  # --no-mtp compiles without it
