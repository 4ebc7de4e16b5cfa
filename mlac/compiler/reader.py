"""Reader: a Hugging Face DeepSeek checkpoint, checked whole before any heavy work, read lazily.

Opens a single `model.safetensors` or a sharded checkpoint (`model.safetensors.index.json`),
parses every header, and checks the tensor set against what the ModelConfig implies: a missing,
extra, misshapen or mistyped tensor is an error naming it. Then it hands out tensors under
mlac's names (one mapping table, below) as LazyTensors read one at a time. An FP8 source weight
comes with its block scale as `<name>.scale`, or is dequantized to bf16 when the target is not FP8.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import dequantize_lazy, scale_shape
from mlac.core.jsonio import load_json
from mlac.core.lazy import LazyTensor
from mlac.core.names import (
    GLOBAL_NAMES,
    MTP_COPIES,
    MTP_NAMES,
    Expected,
    expected_globals,
    expected_layer,
    expected_mtp,
    mlac_layer_name,
)
from mlac.core.safetensors_io import SafetensorsFile, TensorInfo

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RECENT = 2  # source tensors kept after reading (per-rank slices of one tensor are written in turn)


class Checkpoint:
    """A validated HF DeepSeek checkpoint on disk."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise MlacError(f"{model_dir}: not a directory")
        self.config = ModelConfig.from_dir(self.dir)
        self.config_sha256 = hashlib.sha256((self.dir / "config.json").read_bytes()).hexdigest()
        self.index_sha256: str | None = None
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, TensorInfo] = {}  # HF name -> header entry
        self.owner: dict[str, SafetensorsFile] = {}
        self._open()
        self._recent: OrderedDict[str, torch.Tensor] = OrderedDict()  # see `stored`
        self.mtp_layers: list[int] = []
        self.mtp_tensors = 0
        self._check_tensor_set()

    # ---- opening -------------------------------------------------------------------------

    def _open(self) -> None:
        index = self.dir / INDEX
        if index.is_file():
            weight_map = self._read_index(index)
            for shard in sorted(set(weight_map.values())):
                self._add_file(shard, f"{INDEX} names shard {shard!r}")
            for name, shard in weight_map.items():
                if name not in self.files[shard].tensors:
                    raise MlacError(
                        f"{index}: tensor {name!r} is mapped to {shard} but that file does not hold it"
                    )
            for shard, f in self.files.items():
                for name in f.tensors:
                    if weight_map.get(name) != shard:
                        raise MlacError(f"{self.dir / shard}: tensor {name!r} is not listed in {INDEX}")
        elif (self.dir / SINGLE).is_file():
            self._add_file(SINGLE, SINGLE)
        else:
            raise MlacError(f"{self.dir}: no {SINGLE} or {INDEX} found")

    def _read_index(self, index: Path) -> dict[str, str]:
        raw = index.read_bytes()
        self.index_sha256 = hashlib.sha256(raw).hexdigest()
        weight_map = load_json(raw, str(index)).get("weight_map")
        if not isinstance(weight_map, dict):
            raise MlacError(f"{index}: invalid index (expected JSON with a 'weight_map' object)")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or "/" in shard or shard.startswith(".") or not shard:
                raise MlacError(f"{index}: tensor {name!r}: invalid shard file name {shard!r}")
        return weight_map

    def _add_file(self, rel: str, who: str) -> None:
        path = self.dir / rel
        if not path.is_file():
            raise MlacError(f"{who}, which does not exist in {self.dir}")
        f = SafetensorsFile(path)
        self.files[rel] = f
        for name, info in f.tensors.items():
            if name in self.where:
                raise MlacError(f"{path}: tensor {name!r} also appears in {self.owner[name].path.name}")
            self.where[name] = info
            self.owner[name] = f

    # ---- validation ----------------------------------------------------------------------

    def _check_counts(self) -> None:
        """The config's layer and expert counts against the tensors present, before the expected
        tensor set (which grows with them) is built: a config that does not describe this
        checkpoint is one line, not a MemoryError."""
        cfg = self.config
        layers: set[int] = set()
        experts: set[int] = set()
        for name in self.where:
            m = re.match(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?", name)
            if m:
                layers.add(int(m.group(1)))
                if m.group(2) is not None:
                    experts.add(int(m.group(2)))
        held = len(layers) - len([i for i in layers if i >= cfg.num_hidden_layers])
        if cfg.num_hidden_layers > held:
            raise MlacError(
                f"{self.dir / 'config.json'}: num_hidden_layers={cfg.num_hidden_layers}, but the checkpoint holds "
                f"{held} decoder layer(s); the config does not describe these weights"
            )
        n = cfg.n_routed_experts or 0
        if n > len(experts) and any(cfg.is_moe_layer(i) for i in range(min(cfg.num_hidden_layers, held))):
            raise MlacError(
                f"{self.dir / 'config.json'}: n_routed_experts={n}, but the checkpoint holds {len(experts)} "
                "expert(s) per MoE layer; the config does not describe these weights"
            )

    def _check_tensor_set(self) -> None:
        self._check_counts()
        cfg = self.config
        fp8 = cfg.quantization is not None
        expected: dict[str, Expected] = dict(expected_globals(cfg))
        for i in range(cfg.num_hidden_layers):
            expected |= {f"model.layers.{i}.{k}": e for k, e in expected_layer(cfg, i).items()}
        for name, exp in list(expected.items()):
            if fp8 and exp.fp8:
                expected[name.removesuffix(".weight") + ".weight_scale_inv"] = Expected(
                    scale_shape(exp.shape), False
                )
        mtp_range = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        mtp = set()
        for name in sorted(self.where):
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m and int(m.group(1)) in mtp_range:
                mtp.add(int(m.group(1)))
                self.mtp_tensors += 1
            elif name not in expected:
                raise MlacError(
                    f"{self.owner[name].path}: unexpected tensor {name!r} (not part of this {cfg.model_type} config)"
                )
        self.mtp_layers = sorted(mtp)
        for name, exp in expected.items():
            self._check_one(name, exp, fp8)

    def check_mtp(self) -> None:
        """Every MTP layer found holds exactly the tensors of one (expected_mtp), with their shapes
        and dtypes: run before compiling them."""
        fp8 = self.config.quantization is not None
        for n in self.mtp_layers:
            pre = f"model.layers.{n}."
            expected = {pre + k: e for k, e in expected_mtp(self.config, n).items()}
            for name, exp in list(expected.items()):
                if fp8 and exp.fp8:
                    expected[name.removesuffix(".weight") + ".weight_scale_inv"] = Expected(
                        scale_shape(exp.shape), False
                    )
            for name in sorted(x for x in self.where if x.startswith(pre) and x not in expected):
                raise MlacError(f"{self.owner[name].path}: unexpected tensor {name!r} in MTP layer {n}")
            for name, exp in expected.items():
                self._check_one(name, exp, fp8)

    def _check_one(self, name: str, exp: Expected, fp8_source: bool) -> None:
        if name not in self.where:
            raise MlacError(f"{self.dir}: missing tensor {name!r}")
        info = self.where[name]
        where = f"{self.owner[name].path}: tensor {name!r}"
        if info.shape != exp.shape:
            raise MlacError(f"{where} has shape {list(info.shape)}, the config implies {list(exp.shape)}")
        if name.endswith("weight_scale_inv") or name.endswith("e_score_correction_bias"):
            ok = (
                info.dtype == torch.float32
                if name.endswith("weight_scale_inv")
                else info.dtype in FLOAT_DTYPES
            )
            want = "F32" if name.endswith("weight_scale_inv") else "a float dtype"
        elif fp8_source and exp.fp8:
            ok, want = info.dtype == torch.float8_e4m3fn, "F8_E4M3 (the config declares an FP8 checkpoint)"
        else:
            ok, want = info.dtype in FLOAT_DTYPES, "BF16, F16 or F32"
        if not ok:
            raise MlacError(f"{where} has dtype {info.dtype}, expected {want}")

    # ---- reading -------------------------------------------------------------------------

    def read_ahead(self, layer: int) -> None:
        """Ask the kernel to start reading layer `layer`'s tensors into the page cache (async, no
        memory of ours), so that the disk works while the previous layer is transformed."""
        if not hasattr(os, "posix_fadvise"):
            return
        prefix = f"model.layers.{layer}."
        for name, info in self.where.items():
            if name.startswith(prefix):
                fd = os.open(self.owner[name].path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.where.values())

    def source_dtypes(self) -> list[str]:
        return sorted({str(info.dtype).removeprefix("torch.") for info in self.where.values()})

    def stored(self, name: str, on_read: Callable[[int], None] | None = None) -> LazyTensor:
        """A source tensor, read when needed.

        The last RECENT tensors read stay cached, so that the per-rank slices of one tensor,
        written in turn, read it once. Callers must not modify what they get.
        """
        info, f = self.where[name], self.owner[name]

        def produce() -> torch.Tensor:
            if name in self._recent:
                self._recent.move_to_end(name)
                return self._recent[name]
            t = f.read(name)
            if on_read is not None:
                on_read(info.nbytes)
            self._recent[name] = t
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            return t

        return LazyTensor(info.shape, info.dtype, produce)


def read_tensors(
    ckpt: Checkpoint, hf_names: dict[str, str], keep_fp8: bool, on_read: Callable[[int], None] | None = None
) -> dict[str, LazyTensor]:
    """HF name -> mlac name for a group of tensors; pairs FP8 weights with `<mlac>.scale`.

    keep_fp8=False dequantizes an FP8 source weight to bf16 (scale multiplies), lazily.
    """
    out: dict[str, LazyTensor] = {}
    for hf, name in hf_names.items():
        value = ckpt.stored(hf, on_read)
        scale_name = hf.removesuffix(".weight") + ".weight_scale_inv"
        if scale_name not in ckpt.where:
            out[name] = value
        elif keep_fp8:
            out[name] = value
            out[name + ".scale"] = ckpt.stored(scale_name, on_read)
        else:
            out[name] = dequantize_lazy(value, ckpt.stored(scale_name, on_read))
    return out


def read_layer(ckpt: Checkpoint, i: int, keep_fp8: bool, on_read=None) -> dict[str, LazyTensor]:
    names = {
        f"model.layers.{i}.{s}": f"layers.{i}.{mlac_layer_name(s)}" for s in expected_layer(ckpt.config, i)
    }
    return read_tensors(ckpt, names, keep_fp8, on_read)


def read_mtp(ckpt: Checkpoint, n: int, keep_fp8: bool, on_read=None) -> dict[str, LazyTensor]:
    """The MTP layer stored at index n under `layers.{n}.` names (its decoder block as a layer's,
    plus enorm, hnorm, eh_proj, norm), so that the layer passes run on it unchanged; its copies of
    the embedding and head are read apart (read_mtp_copies)."""
    names = {f"model.layers.{n}.{s}": f"layers.{n}.{m}" for s, m in MTP_NAMES.items()}
    return read_layer(ckpt, n, keep_fp8, on_read) | read_tensors(ckpt, names, keep_fp8, on_read)


def read_mtp_copies(ckpt: Checkpoint, n: int, on_read=None) -> dict[str, LazyTensor]:
    """The MTP layer's own embedding and head (`embed`, `head`), as read_globals reads the main ones."""
    names = {f"model.layers.{n}.{s}": m for s, m in MTP_COPIES.items()}
    return read_tensors(ckpt, names, keep_fp8=False, on_read=on_read)


def read_globals(ckpt: Checkpoint, on_read=None) -> dict[str, LazyTensor]:
    return read_tensors(ckpt, GLOBAL_NAMES, keep_fp8=False, on_read=on_read)
