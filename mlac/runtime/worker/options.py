"""RuntimeOptions: how a rank runs an artifact (device, dtype, KV cache size, CUDA graphs, ...),
the innermost layer of the options chain (ServerConfig ⊃ EngineOptions ⊃ RuntimeOptions).

Plain data without torch: `mlac serve` builds the chain and hands it to the engine's process before
its own process imports torch (cli/serve.py), so the engine starts loading sooner."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.core.options import Options
from mlac.core.plan import MAX_BS as MAX_GRAPH_BS
from mlac.core.plan import decode_buckets
from mlac.runtime.expect import kv_cache_dtype_of
from mlac.runtime.model.options import ModelOptions

if TYPE_CHECKING:
    import torch

    from mlac.runtime.worker.kernel_cache import CacheMode

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")  # by torch's names
GRAPH_DTYPES = ("bfloat16", "float16")  # every kernel of the step is a Triton one
ATTENTION_BACKENDS = ("triton", "flashinfer")  # SGLang's --attention-backend names (attention_backend.py)


@dataclass(frozen=True)
class RuntimeOptions(Options):
    """How a rank runs an artifact: on `device` in the compute `dtype` (its name, "bfloat16"; a
    torch.dtype given is kept by its name; `torch_dtype` is the torch.dtype), its files checked for
    size and, with `verify`, sha256; the artifact's kernel
    cache of this GPU used (`kernel_cache`, see kernel_cache.use_kernel_cache). The KV cache's
    size (`num_blocks`, else `kv_cache_bytes`, as build.make_cache; on CUDA with neither, the
    memory plan under `gpu_memory_utilization`, see start.plan_kv), the longest context
    (`max_model_len`, default the model's) and the CUDA graphs of decode steps (on CUDA, in a
    GRAPH_DTYPES compute dtype: float32 runs parts of the step through torch references that
    cannot be captured). `load_overlap`: the weights stream in while the model is built and its
    graphs are captured (build.build_runner); off (tests): load, then build. `require_signature`: a
    PEM public key; the artifact must be signed with its private key (core/signing.py), its units
    too to be used. `attention_backend`: whose kernel the absorbed MLA decode runs, mlac's Triton
    mla_decode or FlashInfer's MLA (worker/attention_backend.py; refused where it cannot run, see
    backend_check.py). `model`: the forms the model runs (runtime/model/options.py; its fields are
    options of this layer by name)."""

    device: torch.device | str = "cpu"  # the CLI passes check_device(--device): cuda when a GPU is present
    dtype: str = "bfloat16"
    verify: bool = True
    kernel_cache: CacheMode = "use"  # "require": refuse to start on a GPU without a cache of its signature
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = 16
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    draft_layers: int = 0  # KV pools for the MTP layers (speculative decoding; the Engine sets it)
    # what the launch states of the artifact (None: any; checked by runtime/expect.py)
    dp_attention: bool | None = None
    tensor_parallel_size: int | None = None  # its plan's tp
    kv_cache_dtype: str | None = None  # its compiled KV cache dtype, as --kv-cache-dtype names it
    load_overlap: bool = True
    require_signature: Path | None = None  # a PEM public key the artifact's signature must verify with
    attention_backend: str = "triton"  # ATTENTION_BACKENDS
    model: ModelOptions = field(default_factory=ModelOptions)

    def __post_init__(self) -> None:
        name = str(self.dtype).removeprefix("torch.")  # torch.bfloat16 prints as "torch.bfloat16"
        if name not in COMPUTE_DTYPES:
            raise MlacError(f"dtype={self.dtype!r}: not a compute dtype ({', '.join(COMPUTE_DTYPES)})")
        object.__setattr__(self, "dtype", name)
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise MlacError("give --kv-cache-bytes or --num-blocks, not both")
        if not 1 <= self.cuda_graph_max_bs <= MAX_GRAPH_BS:
            raise MlacError(f"cuda_graph_max_bs={self.cuda_graph_max_bs}: must be in [1, {MAX_GRAPH_BS}]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise MlacError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise MlacError(f"--max-model-len {self.max_model_len}: must be at least 1")
        kv_cache_dtype_of(self.kv_cache_dtype)  # a name it knows (MlacError otherwise)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise MlacError(
                f"--attention-backend {self.attention_backend!r}: one of {', '.join(ATTENTION_BACKENDS)}"
            )

    @property
    def dtype_name(self) -> str:
        """The compute dtype as the CLI names it: "bfloat16", "float32"."""
        return self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: the options themselves are built before torch is imported (see above)

        return getattr(torch, self.dtype)

    def graphs_on(self, device: torch.device | str) -> bool:
        """Whether decode steps on `device` (this rank's: "cuda", "cuda:1", a torch.device) run as CUDA graphs."""
        on_cuda = str(device).partition(":")[0] == "cuda"
        return self.cuda_graph and on_cuda and self.dtype in GRAPH_DTYPES

    def graph_buckets(self, manifest: Manifest) -> list[int]:
        """The artifact's decode buckets (the buckets pass's, or its default ladder for an
        artifact compiled without them) up to cuda_graph_max_bs, and that size itself."""
        plan = manifest.buckets
        ladder = plan.decode_batch_sizes if plan is not None else decode_buckets(MAX_GRAPH_BS)
        return sorted({b for b in ladder if b < self.cuda_graph_max_bs} | {self.cuda_graph_max_bs})
