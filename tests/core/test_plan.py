"""The buckets pass: the decode ladder, the memory plan's arithmetic, its manifest record, inspect."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from _cli import invoke

from mlac.core import plan as buckets
from mlac.core.artifact import CompileOptions, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.synth.presets import PRESETS

TINY_V2_LITE = ModelConfig.from_hf(PRESETS["tiny-v2-lite"])
LADDER_256 = [1, 2, 4, 8, *range(16, 257, 16)]


@pytest.mark.parametrize(
    "max_bs, ladder",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
        (256, LADDER_256),
    ],
)
def test_decode_ladder(max_bs, ladder):
    assert buckets.decode_buckets(max_bs) == ladder


def test_ladder_of_256_ends_with_240_256_and_4096_is_allowed():
    assert buckets.decode_buckets(256)[-2:] == [240, 256]
    assert buckets.decode_buckets(4096)[-1] == 4096


@pytest.mark.parametrize("bad", [0, -1, 4097])
def test_bad_max_bs_is_refused(bad):
    with pytest.raises(MlacError, match=rf"--cuda-graph-max-bs {bad}: must be an integer in 1\.\.4096"):
        buckets.decode_buckets(bad)


def test_compile_refuses_bad_max_bs_before_writing(checkpoint, tmp_path):
    r = invoke("compile", checkpoint("tiny-v2-lite"), tmp_path / "out", "--cuda-graph-max-bs", 5000)
    assert r.exit_code == 1
    assert (
        r.output.strip().splitlines()[-1] == "error: --cuda-graph-max-bs 5000: must be an integer in 1..4096"
    )
    assert not (tmp_path / "out").exists()


def test_kv_bytes_per_token_by_hand():
    # 3 layers x (kv_lora 64 + rope 16) x 2 bytes (bf16) or 1 byte (fp8); the same on every TP rank
    assert buckets.kv_bytes_per_token(TINY_V2_LITE, CompileOptions()) == 480
    assert buckets.kv_bytes_per_token(TINY_V2_LITE, CompileOptions(tp=2, kv_cache_dtype="fp8_e4m3")) == 240


def test_decode_activation_by_hand():
    # tiny-v2-lite: D 256, V 1024, H 4, kv_lora 64, rope 16, nope 32, v 32, no q_lora, E 8 top-2,
    # I_moe 128 x 2 shared, dense I 512. One token (B = 1), tp 1:
    hidden = 4 * 256 * 2
    attention = 80 * 2 + 4 * 48 * 2 + 2 * 4 * 64 * 2 + 4 * 64 * 65 * 4 + 4 * 32 * 2  # = 68,384
    ffn = (
        2 * 8 * 4 + 2 * 256 * 2 + 2 * 256 * 2 + 2 * (2 + 2 * 127) * 4 + 3 * 256 * 2
    )  # moe: 5,696 > dense 3,072
    logits = 1024 * (2 + 2 + 4)  # 8,192
    assert max(attention, ffn, logits) == attention == 68384
    assert buckets.activation_bytes(TINY_V2_LITE, CompileOptions(), 1, prefill=False) == 2 * (hidden + 68384)
    # tp 2: two local heads halve the attention term
    half = 80 * 2 + 2 * 48 * 2 + 2 * 2 * 64 * 2 + 2 * 64 * 65 * 4 + 2 * 32 * 2  # = 34,272
    assert buckets.activation_bytes(TINY_V2_LITE, CompileOptions(tp=2), 1, prefill=False) == 2 * (
        hidden + half
    )


def test_prefill_activation_by_hand():
    t = 2048  # SchedulerConfig's chunked_prefill_size
    hidden = 4 * t * 256 * 2
    moe = 2 * t * 8 * 4 + 2 * t * 256 * 2 + 2 * t * 256 * 2 + 2 * (2 * t + 8 * 127) * 4 + t * 3 * 256 * 2
    assert moe == 7_512_000 > t * 3 * 512 * 2  # MoE beats the dense MLP, attention and 64 logits rows
    assert buckets.activation_bytes(TINY_V2_LITE, CompileOptions(), t, prefill=True) == 2 * (hidden + moe)


def test_prefill_constants_match_the_scheduler_defaults():
    from mlac.runtime.engine.scheduler import SchedulerConfig

    defaults = SchedulerConfig()
    assert buckets.PREFILL_TOKENS == defaults.chunked_prefill_size
    assert buckets.PREFILL_SEQUENCES == defaults.max_running_requests


def _data_bytes(path) -> int:
    """Bytes of a safetensors file past its header: the tensor data."""
    raw = path.read_bytes()
    return len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]


def test_compiled_artifact_records_the_plan(checkpoint, tmp_path):
    out = tmp_path / "out"
    r = invoke("compile", checkpoint("tiny-v2-lite"), out, "--tp", 2, "--cuda-graph-max-bs", 100,
               "--skip-accuracy-check")  # fmt: skip
    assert r.exit_code == 0, r.output
    m = Manifest.load(out)
    assert m.options.cuda_graph_max_bs == 100
    assert m.passes[-1].name == "buckets"
    assert m.passes[-1].params == {"cuda_graph_max_bs": 100, "buckets": 11, "safety_factor": 2.0,
                                   "prefill_tokens": 2048}  # fmt: skip
    b = m.buckets
    assert b.decode_batch_sizes[-2:] == [96, 100] and b.cuda_graph_max_bs == 100
    assert b.weight_bytes == [sum(_data_bytes(p) for p in sorted((out / m.rank_dir(r)).glob("*.safetensors")))
                              for r in range(2)]  # fmt: skip
    assert b.kv_bytes_per_token == 480
    assert len(b.activation_bytes) == 11 and b.activation_bytes == sorted(b.activation_bytes)
    assert b.graph_pool_bytes == b.activation_bytes[-1]
    assert b.prefill_tokens == 2048 and b.safety_factor == 2.0


def test_default_compile_and_inspect_show_the_plan(artifact):
    root = artifact("tiny-v3", fp8=True)
    m = Manifest.load(root)
    assert m.buckets.decode_batch_sizes == LADDER_256 and m.options.cuda_graph_max_bs == 256
    assert [p.name for p in m.passes][-2:] == ["fp8", "buckets"]
    r = invoke("inspect", root)
    assert r.exit_code == 0, r.output
    assert (
        "buckets       20 decode batch sizes: 1, 2, 4, 8, 16, ..., 256 (--cuda-graph-max-bs 256)" in r.output
    )
    # tiny-v3: 3 layers x (kv_lora 128 + rope 32) x 2 bytes
    assert "KV cache 960 bytes/token per rank" in r.output and "CUDA-graph pool" in r.output
    r = invoke("inspect", root, "--json")
    assert json.loads(r.output)["buckets"]["decode_batch_sizes"] == LADDER_256


def test_manifest_without_buckets_still_loads(artifact, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(artifact("tiny-v2-lite"), root)
    raw = json.loads((root / "manifest.json").read_text())
    del raw["buckets"], raw["options"]["cuda_graph_max_bs"]  # as written before the buckets pass
    (root / "manifest.json").write_text(json.dumps(raw))
    assert Manifest.load(root).buckets is None
    r = invoke("inspect", root)
    assert r.exit_code == 0 and "buckets       none" in r.output, r.output
