"""mlac.synth: synthetic DeepSeek checkpoints (structure, FP8 format, determinism, sharding,
tokenizer, bad input, and a transformers forward pass that stays sane).

The real published configs (tests/configs/*.json) are exercised at the end, in the tests named
test_real_config_*; the ones that write multi-GB checkpoints are marked slow.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _paths import CONFIGS
from safetensors import safe_open

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import FP8_MAX, dequantize_blocks
from mlac.synth import PRESETS, synthesize, weight_bytes
from mlac.synth.checkpoint import resolve_config
from mlac.synth.tokenizer import ADDED_TOKENS, ASSISTANT, BOS, EOS, MAX_VOCAB, USER, train_tokenizer
from mlac.synth.weights import checkpoint_params, draw_values

TINY = ["tiny-v2-lite", "tiny-v2", "tiny-v3"]
CONFIGS = CONFIGS
REAL = ["DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "DeepSeek-R1"]

PROMPTS = [
    "The morning train left the station a few minutes after seven. Most of the passengers were reading, "
    "some were asleep, and a small child by the window counted the bridges as they passed.",
    "A compiler reads a program and writes another one. Between the two sit many small passes, each of "
    "which changes one thing and keeps the meaning of the whole.",
    "Questions and answers. What is the capital of France? Paris. How many days are there in a leap year? "
    "There are 366 days. Which planet is closest to the sun? Mercury.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth")
    return {name: synthesize(root / name, preset=name, seed=0) for name in TINY}


def read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# presets and structure


def test_presets_parse_and_keep_their_features():
    cfgs = {name: ModelConfig.from_hf(raw, source=name) for name, raw in PRESETS.items()}
    lite, v2, v3 = cfgs["tiny-v2-lite"], cfgs["tiny-v2"], cfgs["tiny-v3"]
    assert lite.q_lora_rank is None and lite.topk_method == "greedy" and lite.rope_scaling is None
    assert v2.topk_method == "group_limited_greedy" and v2.n_group == 4 and v2.routed_scaling_factor != 1
    assert v3.topk_method == "noaux_tc" and v3.scoring_func == "sigmoid" and v3.norm_topk_prob
    assert v3.quantization is not None and v3.num_nextn_predict_layers == 1
    assert v3.q_lora_rank % 128 == 0 and v3.kv_latent_dim % 128 != 0  # aligned q_a, partial kv_a block
    assert v2.rope_scaling is not None and v3.rope_scaling is not None
    assert cfgs["v2-lite"].num_hidden_layers == 27
    total = sum(math.prod(p.shape) for p in checkpoint_params(cfgs["v2-lite"]))
    assert 15.6e9 < total < 15.8e9


def expected_names(cfg: ModelConfig) -> set[str]:
    """The official HF names, written out independently of mlac.synth.weights."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    fp8 = cfg.quantization is not None

    def linear(name: str) -> None:
        names.add(name + ".weight")
        if fp8:
            names.add(name + ".weight_scale_inv")

    def mlp(pre: str) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear(f"{pre}.{proj}")

    def layer(i: int) -> None:
        pre = f"model.layers.{i}"
        names.update({f"{pre}.input_layernorm.weight", f"{pre}.post_attention_layernorm.weight"})
        a = f"{pre}.self_attn"
        if cfg.q_lora_rank is None:
            linear(f"{a}.q_proj")
        else:
            linear(f"{a}.q_a_proj")
            linear(f"{a}.q_b_proj")
            names.add(f"{a}.q_a_layernorm.weight")
        linear(f"{a}.kv_a_proj_with_mqa")
        linear(f"{a}.kv_b_proj")
        linear(f"{a}.o_proj")
        names.add(f"{a}.kv_a_layernorm.weight")
        if i < cfg.first_k_dense_replace:
            mlp(f"{pre}.mlp")
            return
        names.add(f"{pre}.mlp.gate.weight")
        if cfg.topk_method == "noaux_tc":
            names.add(f"{pre}.mlp.gate.e_score_correction_bias")
        for e in range(cfg.n_routed_experts):
            mlp(f"{pre}.mlp.experts.{e}")
        mlp(f"{pre}.mlp.shared_experts")

    for i in range(cfg.num_hidden_layers):
        layer(i)
    for k in range(cfg.num_nextn_predict_layers):
        n = cfg.num_hidden_layers + k
        layer(n)
        pre = f"model.layers.{n}"
        names.update({f"{pre}.{t}.weight" for t in ("enorm", "hnorm", "embed_tokens", "shared_head.norm")})
        names.add(f"{pre}.shared_head.head.weight")
        linear(f"{pre}.eh_proj")
    return names


@pytest.mark.parametrize("name", TINY)
def test_names_shapes_dtypes(tiny, name):
    path = tiny[name]
    cfg = ModelConfig.from_dir(path)
    t = read_all(path)
    assert set(t) == expected_names(cfg)
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    assert t["model.embed_tokens.weight"].shape == (V, D) and t["lm_head.weight"].shape == (V, D)
    a = "model.layers.1.self_attn"
    assert t[f"{a}.kv_a_proj_with_mqa.weight"].shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
    assert t[f"{a}.kv_b_proj.weight"].shape == (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    assert t[f"{a}.o_proj.weight"].shape == (D, H * cfg.v_head_dim)
    q = t[f"{a}.q_proj.weight"] if cfg.q_lora_rank is None else t[f"{a}.q_b_proj.weight"]
    assert q.shape[0] == H * cfg.qk_head_dim
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, D)
    assert t["model.layers.1.mlp.gate.weight"].shape == (cfg.n_routed_experts, D)
    assert t["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (D, cfg.moe_intermediate_size)
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (shared, D)
    for k, v in t.items():
        if k.endswith("e_score_correction_bias") or k.endswith("_scale_inv"):
            assert v.dtype == torch.float32, k
        elif v.dtype != torch.float8_e4m3fn:
            assert v.dtype == torch.bfloat16, k
    cfg_json = config_of(path)
    assert cfg_json["torch_dtype"] == "bfloat16"
    assert cfg_json == {**PRESETS[name], "bos_token_id": 0, "eos_token_id": 1}


def test_mtp_layer(tiny):
    t = read_all(tiny["tiny-v3"])
    n, D, V = 3, 256, PRESETS["tiny-v3"]["vocab_size"]
    assert t[f"model.layers.{n}.eh_proj.weight"].shape == (D, 2 * D)
    assert t[f"model.layers.{n}.eh_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[f"model.layers.{n}.shared_head.head.weight"].shape == (V, D)
    # as released, the MTP copies of the embedding and head equal the main ones
    assert torch.equal(t[f"model.layers.{n}.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t[f"model.layers.{n}.shared_head.head.weight"], t["lm_head.weight"])
    assert f"model.layers.{n}.mlp.experts.15.up_proj.weight_scale_inv" in t


# ---------------------------------------------------------------------------------------------
# FP8


def test_fp8_blocks(tiny):
    path = tiny["tiny-v3"]
    cfg = ModelConfig.from_dir(path)
    t = read_all(path)
    fp8 = {k for k, v in t.items() if v.dtype == torch.float8_e4m3fn}
    assert {k + "_scale_inv" for k in fp8} == {k for k in t if k.endswith("_scale_inv")}
    assert not fp8 & {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert not fp8 & {"model.layers.1.mlp.gate.weight", "model.layers.3.shared_head.head.weight"}
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in fp8
    params = {p.name: p for p in checkpoint_params(cfg)}
    for name in sorted(fp8):
        q, s = t[name], t[name + "_scale_inv"]
        rows, cols = q.shape
        assert s.shape == (math.ceil(rows / 128), math.ceil(cols / 128)), name
        assert torch.isfinite(q.float()).all() and (s > 0).all()
        # every 128x128 block (partial ones too) uses the full e4m3 range
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                block = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
                assert block.abs().max() == FP8_MAX, (name, i, j)
        w = dequantize_blocks(q, s)
        ref = draw_values(params[name], 0, 0, rows, torch.float32)  # one chunk: tiny tensors
        assert (w - ref).norm() / ref.norm() < 0.04, name  # e4m3: 3 mantissa bits
        assert 0.8 < w.std().item() * cols**0.5 < 1.2, name  # the bf16 init's scale survived
    kv_a = t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape[0] % 128 != 0  # the partial block row is exercised


def test_fp8_matches_transformers_dequantization(tiny):
    """transformers' own FP8 dequantizer reads our blocks the same way (full blocks only: its CPU
    path derives the block from the scale grid and mis-reads partial blocks, kv_a_proj here)."""
    pytest.importorskip("accelerate")
    from transformers import DeepseekV3ForCausalLM

    path = tiny["tiny-v3"]
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    t = read_all(path)
    checked = 0
    for name, param in model.named_parameters():
        if name + "_scale_inv" in t and t[name].shape[0] % 128 == 0 and t[name].shape[1] % 128 == 0:
            ours = dequantize_blocks(t[name], t[name + "_scale_inv"])
            torch.testing.assert_close(param.detach().float(), ours, rtol=4e-3, atol=0, msg=name)
            checked += 1
    assert checked >= 10


# ---------------------------------------------------------------------------------------------
# transformers forward: sane activations through every layer


def hf_class(name: str):
    import transformers

    v3 = PRESETS[name]["model_type"] == "deepseek_v3"
    return transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM


@pytest.mark.parametrize("name", TINY)
def test_transformers_forward_is_sane(tiny, name):
    if name == "tiny-v3":
        pytest.importorskip("accelerate")  # transformers dequantizes FP8 on CPU through it
    from transformers import AutoTokenizer

    path = tiny[name]
    tok = AutoTokenizer.from_pretrained(path)
    model = hf_class(name).from_pretrained(path, dtype=torch.float32)
    vocab = config_of(path)["vocab_size"]
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] >= 32
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        for i, h in enumerate(out.hidden_states):
            assert torch.isfinite(h).all(), (prompt, i)
            assert 0.05 < h.std().item() < 50, (prompt, i, h.std().item())
        logits = out.logits[0]  # [T, V]
        assert torch.isfinite(logits).all()
        assert logits.std(-1).min() > 0.5
        top1 = logits.argmax(-1)
        assert top1.unique().numel() >= ids.shape[1] // 4  # predictions depend on the input
        p_max = logits.softmax(-1).max(-1).values
        assert (p_max < 0.99).all() and (p_max > 5 / vocab).all()  # neither one-hot nor uniform
    gen = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    assert gen.numel() == 32 and gen.unique().numel() >= 4
    assert tok.decode(gen, skip_special_tokens=True).strip()


# ---------------------------------------------------------------------------------------------
# determinism, sharding, progress


def files_of(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = files_of(synthesize(tmp_path / "a", preset="tiny-v3", seed=0))
    assert again == files_of(tiny["tiny-v3"])
    other = files_of(synthesize(tmp_path / "b", preset="tiny-v3", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"] and other["config.json"] == again["config.json"]


@pytest.mark.parametrize("name", ["tiny-v2", "tiny-v3"])
def test_sharding_and_index(tiny, tmp_path, name):
    limit = 1_000_000
    seen = []
    path = synthesize(tmp_path / name, preset=name, max_shard_bytes=limit, progress=seen.append)
    files = sorted(path.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and not (path / "model.safetensors").exists()
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    total = 0
    for f in files:
        with safe_open(f, "pt") as st:
            keys = list(st.keys())
            assert all(index["weight_map"][k] == f.name for k in keys)
            size = sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in keys)
        assert size <= limit or len({k.removesuffix("_scale_inv") for k in keys}) == 1
        total += size
    assert index["metadata"]["total_size"] == total == weight_bytes(name) == sum(seen)
    sharded, single = read_all(path), read_all(tiny[name])
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert all(torch.equal(sharded[k].view(torch.uint8), single[k].view(torch.uint8)) for k in single)


def test_num_layers_override(tmp_path):
    raw = resolve_config("tiny-v3", None, 1)
    assert raw["num_hidden_layers"] == 1 and raw["first_k_dense_replace"] == 0  # its one layer is MoE
    v3 = CONFIGS / "DeepSeek-V3.json"
    assert resolve_config(None, v3, 2)["first_k_dense_replace"] == 1  # dense layer 0, MoE layer 1
    assert resolve_config(None, v3, 5)["first_k_dense_replace"] == 3
    assert resolve_config(None, v3, None)["num_hidden_layers"] == 61
    path = synthesize(tmp_path / "two", preset="tiny-v3", num_layers=2)
    cfg = ModelConfig.from_dir(path)
    assert cfg.num_hidden_layers == 2 and cfg.first_k_dense_replace == 1
    assert set(read_all(path)) == expected_names(cfg)  # the MTP layer is now model.layers.2


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer(tiny):
    from transformers import AutoTokenizer

    path = tiny["tiny-v2"]
    cfg = config_of(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == min(cfg["vocab_size"], MAX_VOCAB) >= 1000
    special = [tok.convert_tokens_to_ids(s) for s in (BOS, EOS, USER, ASSISTANT)]
    assert special == [0, 1, 2, 3] and max(special) < cfg["vocab_size"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    for text in ["Hello, world!", "  two  spaces\nand\ttabs", "ünïcödé 漢字 🙂", PROMPTS[0]]:
        ids = tok(text).input_ids
        assert ids[0] == 0  # bos
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok(PROMPTS[0]).input_ids) < len(PROMPTS[0]) / 2.5  # real merges, not bytes
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Two plus three?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello.{EOS}{USER}Two plus three?{ASSISTANT}"
    ids = tok.apply_chat_template(messages[1:2], tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[:2] == [0, 2] and ids.count(0) == 1  # one bos, then <｜User｜>


def test_tokenizer_has_deepseeks_tool_and_think_tokens(tiny):
    """The last ids are the tokens DeepSeek's tokenizers add for tool calls and thinking, not
    special: decoded text keeps them (the parsers read them there), and each is one id."""
    from transformers import AutoTokenizer

    from mlac.runtime.serve.reasoning import CLOSE, OPEN
    from mlac.runtime.serve.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

    path = tiny["tiny-v3"]
    tok = AutoTokenizer.from_pretrained(path)
    n = len(tok)
    assert [tok.convert_tokens_to_ids(t) for t in ADDED_TOKENS] == list(range(n - len(ADDED_TOKENS), n))
    assert {CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, OPEN, CLOSE} <= set(ADDED_TOKENS)
    text = f"Hi{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{}}{CALL_END}{CALLS_END}{OPEN}x{CLOSE}"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert sum(i >= n - len(ADDED_TOKENS) for i in ids) == 7


def test_tokenizer_is_deterministic():
    assert train_tokenizer(1024).to_str() == train_tokenizer(1024).to_str()
    assert train_tokenizer(300).get_vocab_size() == 300


# ---------------------------------------------------------------------------------------------
# bad input


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name]


def test_bad_inputs(tmp_path):
    with pytest.raises(MlacError, match="tiny-v2-lite, tiny-v2, tiny-v3, v2-lite"):
        synthesize(tmp_path / "x", preset="tiny-v9")
    with pytest.raises(MlacError, match="exactly one"):
        synthesize(tmp_path / "x")
    with pytest.raises(MlacError, match="exactly one"):
        synthesize(tmp_path / "x", preset="tiny-v2", config_path=CONFIGS / "DeepSeek-V3.json")
    with pytest.raises(MlacError, match="not found"):
        synthesize(tmp_path / "x", config_path=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(MlacError, match="invalid JSON"):
        synthesize(tmp_path / "x", config_path=tmp_path / "bad.json")
    (tmp_path / "llama.json").write_text(json.dumps({**PRESETS["tiny-v2"], "model_type": "llama"}))
    with pytest.raises(MlacError, match="model_type"):
        synthesize(tmp_path / "x", config_path=tmp_path / "llama.json")
    with pytest.raises(MlacError, match="num_layers"):
        synthesize(tmp_path / "x", preset="tiny-v2", num_layers=0)
    (tmp_path / "small.json").write_text(json.dumps({**PRESETS["tiny-v2"], "vocab_size": 100}))
    with pytest.raises(MlacError, match="vocab_size"):
        synthesize(tmp_path / "x", config_path=tmp_path / "small.json")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(MlacError, match="not empty"):
        synthesize(full, preset="tiny-v2")
    assert (full / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(MlacError, match="not a directory"):
        synthesize(tmp_path / "file", preset="tiny-v2")
    assert not (tmp_path / "x").exists() and no_leftovers(tmp_path)


def test_existing_empty_dir_and_config_dir_are_accepted(tmp_path):
    (tmp_path / "empty").mkdir()
    path = synthesize(tmp_path / "empty", preset="tiny-v2-lite")
    again = synthesize(tmp_path / "again", config_path=path)  # a checkpoint dir as the config
    assert config_of(again) == config_of(path)


def test_interrupted_run_leaves_nothing(tmp_path):
    def stop(_: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthesize(tmp_path / "ckpt", preset="tiny-v2", progress=stop)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# the real published configs


def real_config_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", d / "config.json")
    return d


# name -> (parameters incl. MTP, layers, routed experts); V3/R1: 671B main + the MTP module
REAL_SIZES = {
    "DeepSeek-V2-Lite": (15.706e9, 27, 64),
    "DeepSeek-V2": (235.74e9, 60, 160),
    "DeepSeek-V3": (684.49e9, 61, 256),
    "DeepSeek-R1": (684.49e9, 61, 256),
}


@pytest.mark.parametrize("name", REAL)
def test_real_config_parses_and_counts(tmp_path, name):
    params, layers, experts = REAL_SIZES[name]
    cfg = ModelConfig.from_dir(real_config_dir(tmp_path, name))
    assert (cfg.num_hidden_layers, cfg.n_routed_experts) == (layers, experts)
    assert (cfg.quantization is not None) == (cfg.model_type == "deepseek_v3")
    total = sum(math.prod(p.shape) for p in checkpoint_params(cfg))
    assert abs(total - params) / params < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_real_config_synthesizes_two_layers(tmp_path, name):
    """synthesize(config_path=<real config>, num_layers=2) at real widths and vocabulary.

    V2, V3 and R1 keep 16 of their routed experts (a 2-layer V3 with all 256 is 31 GB); every
    other field, the vocabulary and all widths are the published ones. V2-Lite is taken whole.
    """
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    if raw["n_routed_experts"] > 64:
        raw["n_routed_experts"] = 16
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    out = tmp_path / "ckpt"
    try:
        synthesize(out, config_path=config, num_layers=2)
        cfg = ModelConfig.from_dir(out)
        assert cfg.num_hidden_layers == 2 and cfg.first_k_dense_replace == 1
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == expected_names(cfg)
        assert index["metadata"]["total_size"] == weight_bytes(config_path=config, num_layers=2)
        shards = {}
        for file in sorted(set(index["weight_map"].values())):
            with safe_open(out / file, "pt") as f:
                shards.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()})
        D, V = cfg.hidden_size, cfg.vocab_size
        assert shards["model.embed_tokens.weight"] == ("BF16", [V, D])
        kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
        if cfg.quantization is not None:
            assert shards[kv_a] == ("F8_E4M3", [576, D])
            assert shards[kv_a + "_scale_inv"] == ("F32", [5, math.ceil(D / 128)])  # 576 = 4.5 blocks
            assert shards["model.layers.2.eh_proj.weight"] == ("F8_E4M3", [D, 2 * D])
        else:
            assert shards[kv_a] == ("BF16", [576, D])
    finally:
        shutil.rmtree(out, ignore_errors=True)
