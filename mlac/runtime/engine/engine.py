"""Engine: load an artifact, then score or generate.

    engine = Engine.from_artifact("out/")
    engine.generate("Hello", max_tokens=32).text                      # one prompt -> Completion
    engine.generate(["Hi", "Bye"], SamplingParams(max_tokens=8))      # a batch -> [Completion]
    for delta in engine.stream("Hello", max_tokens=32):               # one request, streamed
        print(delta.text, end="")

`generate` and `stream` run through the continuous-batching Scheduler (scheduler.py) in the
caller's thread; the HTTP server runs one long-lived scheduler in a background thread. Every step
is a `Step` (step.py) run by the runner: decode steps through CUDA graphs on a GPU.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mlac.core.artifact import TOKENIZER_DIR, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import FP8
from mlac.core.options import build
from mlac.core.validity import check_artifact
from mlac.kernels.gemm.fp8_gemm import sm_count
from mlac.kernels.gemm.gemv_configs import DENSE_DTYPES
from mlac.kernels.step_variants import MoeShape, StepShapes, warmup_token_counts
from mlac.runtime.engine.constrain import Grammars
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.penalties import Penalties, check_logit_bias
from mlac.runtime.engine.prompt_logprobs import check_prompt_logprobs
from mlac.runtime.engine.sampling import TokenLogprob, make_generator, sample
from mlac.runtime.engine.scheduler import Scheduler, SchedulerConfig
from mlac.runtime.engine.sequence import Delta, FinishReason
from mlac.runtime.engine.sequence import Sequence as Seq
from mlac.runtime.engine.spec.decode import check_spec
from mlac.runtime.engine.tokenizer import Tokenizer
from mlac.runtime.kvcache.shared_prefix import step_sums
from mlac.runtime.model.attention import ABSORBED_MAX_Q_LEN, prefer_shared
from mlac.runtime.model.layers import Linear, Weights
from mlac.runtime.model.model import DeepseekModel, MoE
from mlac.runtime.model.parallel import ParallelLMHead
from mlac.runtime.step import Step
from mlac.runtime.worker.backend_check import check_backend
from mlac.runtime.worker.build import make_cache
from mlac.runtime.worker.kernel_cache import use_kernel_cache
from mlac.runtime.worker.loader import to_compute_dtype
from mlac.runtime.worker.runner import ModelRunner
from mlac.runtime.worker.start import make_runner

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Completion:
    text: str  # without eos / stop tokens, cut before a stop string
    token_ids: list[int]  # every generated token, the final eos / stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), when asked


def is_one_prompt(prompt: object) -> bool:
    """A string or a sequence of token ids is one prompt; a list of those is a batch."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() <= 1
    return isinstance(prompt, Sequence) and all(isinstance(t, numbers.Integral) for t in prompt)


class Engine:
    """A model, its tokenizer and a paged KV cache on one device (one rank)."""

    def __init__(
        self,
        config: ModelConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None = None,
        manifest: Manifest | None = None,
        options: EngineOptions | None = None,
    ):
        options = options or EngineOptions()
        self.config = config
        self.runner = runner
        self.cache = runner.cache  # rank 0's KV cache: its capacity
        self.pool = runner.kv_pools[0]  # its blocks: allocator and prefix tree (rank 0's bookkeeping)
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.device = runner.device
        self.scheduler_config = options.scheduler
        self.max_model_len = options.runtime.max_model_len  # caps max_context (None: max_position_embeddings)
        # the start's phases in seconds and sizes (the runner's load and graphs; the server adds more)
        self.startup: dict[str, float] = dict(getattr(runner, "startup", {}))
        self._seq_ids = itertools.count()
        self.grammars = Grammars(tokenizer, config.vocab_size, config.eos_token_ids)  # built on first use

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_artifact(cls, path: str | Path, options: EngineOptions | None = None, **fields: Any) -> Engine:
        """Verify (sizes, and sha256 unless runtime.verify is False) and load an artifact as `options`
        say (default EngineOptions()), with `fields` changed: names of EngineOptions, RuntimeOptions
        or SchedulerConfig fields, e.g. `Engine.from_artifact("out/", device="cpu",
        dtype=torch.float32, num_blocks=64, max_running_requests=8)`.

        The KV cache holds `num_blocks`, else `kv_cache_bytes`, else on CUDA what the artifact's
        memory plan leaves of `gpu_memory_utilization` of the GPU after weights, graphs and
        activations (decided before loading: MlacError when nothing fits), else (CPU) 1 GiB capped
        at what four sequences of max_position_embeddings tokens need; in the artifact's
        kv_cache_dtype. `max_model_len` caps max_context. On CUDA, decode steps of up to
        `cuda_graph_max_bs` sequences run as CUDA graphs (captured here) unless `cuda_graph` is
        False. `launch` says how the ranks of a multi-rank artifact find each other (see
        start.make_runner). `kernel_cache`: use the artifact's compile cache of this GPU if it
        holds one ("require": refuse to start without), before any kernel is compiled
        (kernel_cache.use_kernel_cache). `dp_attention`: True / False refuses an artifact whose plan
        says otherwise (None: any). `chat_template`: a Jinja file used instead of the artifact's.
        `require_signature`: a PEM public key; the artifact's signature must verify with it before
        anything loads, and a kernel-cache unit is used only if signed by it too.
        `attention_backend`: "flashinfer" runs decode attention through FlashInfer's MLA kernel
        (worker/attention_backend.py), refused before anything loads where it cannot run
        (backend_check.py), with the unit's FlashInfer modules when it holds them."""
        options = build(EngineOptions, fields, options)
        rt = options.runtime
        # the one check of a valid artifact (core/validity.py; the bytes are hashed as each rank reads
        # them), and its signature when required: before anything loads
        checked = check_artifact(
            path, hashes=False, identity_required=rt.verify, public_key=rt.require_signature
        )
        manifest = checked.manifest
        check_backend(rt, manifest)  # --attention-backend flashinfer where it cannot run: one line
        use_kernel_cache(checked, rt.device, rt.kernel_cache, rt.verify, public_key=rt.require_signature,
                         attention_backend=rt.attention_backend)  # fmt: skip
        spec = options.scheduler.speculative_num_steps
        check_spec(spec, manifest.mtp is not None, manifest.plan.dp_attention)
        draft_layers = len(manifest.mtp.prefixes) if spec and manifest.mtp is not None else 0
        runner = make_runner(path, manifest, replace(rt, draft_layers=draft_layers), launch=options.launch)
        tok_dir = Path(path) / TOKENIZER_DIR
        tokenizer = Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        if options.chat_template is not None and tokenizer is not None:
            tokenizer.use_chat_template(options.chat_template)
        return cls(manifest.model, runner, tokenizer, manifest, options)

    @classmethod
    def from_tensors(
        cls,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None = None,
        options: EngineOptions | None = None,
        kv_dtype: str = "bf16",
        **fields: Any,
    ) -> Engine:
        """An engine over in-memory tensors under mlac names (tests, tools), cast as the loader does;
        `options` and `fields` as from_artifact's (the runtime's device, dtype and KV cache size;
        the scheduler's limits); `kv_dtype` the KV cache's element type."""
        options = build(EngineOptions, fields, options)
        rt = options.runtime
        tensors = {k: to_compute_dtype(k, t, rt.torch_dtype).to(rt.device) for k, t in tensors.items()}
        model = DeepseekModel(config, Weights(tensors, source="tensors"))
        spec = options.scheduler.speculative_num_steps
        check_spec(spec, len(model.mtp) > 0)
        extra = len(model.mtp) if spec else 0
        cache = make_cache(config, rt.device, rt.torch_dtype, rt.num_blocks, rt.kv_cache_bytes, rt.block_size, kv_dtype,
                           None, extra)  # fmt: skip
        runner = ModelRunner(model, cache)
        return cls(config, runner, tokenizer, options=options)

    def close(self) -> None:
        """Stop what the engine started (the other ranks' processes of a multi-rank artifact)."""
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- limits ------------------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold."""
        return min(self.max_model_len or self.config.max_position_embeddings, self.cache.capacity_tokens)

    def _check_prompt(self, ids: Sequence[int]) -> None:
        if not ids:
            raise MlacError("empty prompt: at least one token is needed")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise MlacError(f"token id {bad} out of range for vocabulary size {vocab}")
        max_pos = self.config.max_position_embeddings
        if len(ids) > max_pos:
            raise MlacError(f"prompt of {len(ids)} tokens exceeds max_position_embeddings={max_pos}")
        if self.max_model_len is not None and len(ids) > self.max_model_len:
            raise MlacError(f"prompt of {len(ids)} tokens exceeds max_model_len={self.max_model_len}")
        if len(ids) > self.cache.capacity_tokens:
            raise MlacError(
                f"prompt of {len(ids)} tokens exceeds the KV cache ({self.cache.capacity_tokens} tokens)"
            )

    # ---- model steps -------------------------------------------------------------------------

    def score(self, token_ids: Sequence[int] | torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [T, V] float32 of every position (prefill, in chunks if asked)."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        self._check_prompt(ids)
        step = chunk_size or len(ids)
        table: list[int] = []
        try:
            self.pool.allocator.reserve(table, len(ids))
            out = [
                self.runner.run(Step.of([ids[s : s + step]], [s], [table], every_token=True))
                for s in range(0, len(ids), step)
            ]
        finally:
            self.pool.allocator.free(table)
        return torch.cat(out)

    # ---- warm-up -----------------------------------------------------------------------------

    def warmup(self, force: bool = False) -> list[tuple[int, int]]:
        """Run once the step shapes a server meets, so that Triton compiles (JIT) its kernels before
        the first request rather than during it. CUDA only (nothing is compiled on CPU) unless
        `force`. Returns the (sequences, prompt tokens each) batches it ran; each runs its prefill
        and one decode step, and gives its blocks back.

        Triton compiles a kernel per constexpr config, which the wrappers pick from the token count
        (GEMM decode / mid / prefill tiles, MoE rows per expert, MHA or absorbed prefill form), and
        per integer argument equal to 1 or divisible by 16. Hence decode batches of 1, 3, 16 and
        max_running_requests (4-token prompts: absorbed-form prefills of 4-4·max tokens), and
        one-sequence prefills of 100 tokens (MHA form) and of the chunk size, each run a second time
        with the prefix cache on (an extend after a cached prefix); and one-sequence prefills of the
        token counts that meet every kernel variant (tile config, K split, ...) the GEMMs, the grouped
        MoE and the router pick for steps of 1 to the chunk size tokens (step_variants.py: a burst of
        cached requests, a prefill's tail, run eager steps of any size in between).
        Then the sampler's top-p kernel (`_warm_sampler`); with the prefix cache, last, the shared-prefix
        extend (`_warm_shared_prefix`).
        Shapes that do not fit the KV cache or the context are left out."""
        if self.device.type != "cuda" and not force:
            return []
        limits = self.scheduler_config
        shapes = [(n, 4) for n in sorted({1, 3, 16, limits.max_running_requests})]
        single = sorted({100, limits.chunked_prefill_size})
        variants = self._variant_lengths(limits.chunked_prefill_size)
        shapes += [(1, n) for n in sorted(set(single) | set(variants))]
        vocab, alloc, ran = self.config.vocab_size, self.pool.allocator, []
        for k, (n_seq, want) in enumerate(shapes):
            length = min(want, self.max_context - 2)  # prompt + 2 tokens fit the context
            if length < 1 or n_seq * alloc.blocks_for(length + 2) > alloc.num_free:
                continue
            # each shape's own prompts (k): one shape's must not be a cached prefix of the next's
            prompts = [
                [3 + (i * 31 + j * 7 + k * 13) % (vocab - 3) for j in range(length)] for i in range(n_seq)
            ]
            self.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
            twice = n_seq == 1 and want in single  # the variants' lengths once: their kernels are met
            if self.scheduler_config.prefix_cache and twice and length > alloc.block_size:
                self.generate(
                    prompts, SamplingParams(max_tokens=2, ignore_eos=True)
                )  # an extend after a cached prefix
            ran.append((n_seq, length))
        self._warm_sampler()
        return ran + self._warm_shared_prefix()

    def _warm_sampler(self) -> None:
        """The sampler's own kernels (kernels/top_p.py: top-p without a top-k), on one row of logits of
        the model's vocabulary (the width their launches are specialized on; the rows are not)."""
        logits = torch.zeros(1, self.config.vocab_size, device=self.device)
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.95)], [None])

    def _warm_shared_prefix(self) -> list[tuple[int, int]]:
        """The shared-prefix extend's kernel (attention.extend_shared): a prompt cached, then,
        in one step, sequences after it with tails of their own and one sequence that shares
        nothing. The prefix is doubled from two blocks until prefer_shared takes the cascade for that
        step, and the step has more rows than the CUDA graphs take (a step of at most their largest
        bucket replays a graph instead). Returns [(sequences, tokens of the longest)], empty
        without the prefix cache or the cascade (ModelOptions.shared_prefix), or when no such step
        fits."""
        limits, alloc, vocab = self.scheduler_config, self.pool.allocator, self.config.vocab_size
        if not (limits.prefix_cache and self.runner.model.options.shared_prefix):
            return []
        attn = self.runner.model.layers[0].attn
        graphs, tail = self.runner.graphs, ABSORBED_MAX_Q_LEN
        sharers = max(3, -(-((graphs.max_bs if graphs is not None else 0) + 1) // tail))
        n_seq = sharers + 1
        if n_seq > limits.max_running_requests or n_seq * tail > limits.chunked_prefill_size:
            return []
        q_lens = [tail] * n_seq
        length = 2 * alloc.block_size
        while True:
            ctx = [length] * sharers + [0]
            if prefer_shared(length, step_sums(q_lens, ctx, [0] * n_seq), attn.w_kc, attn.w_vc, attn.rope):
                break
            length *= 2
            if length + tail + 2 > self.max_context:
                return []
        if (n_seq + 1) * alloc.blocks_for(length + tail + 2) > alloc.num_free:
            return []
        prefix = [5 + (j * 11) % (vocab - 5) for j in range(length)]
        self.generate([prefix + [4]], SamplingParams(max_tokens=1))  # caches the prefix's blocks
        tails = [[3 + (i * 17 + j * 5) % (vocab - 3) for j in range(tail)] for i in range(n_seq)]
        prompts = [prefix + t for t in tails[:sharers]] + tails[sharers:]
        self.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        return [(n_seq, length + tail)]

    def _variant_lengths(self, max_tokens: int) -> list[int]:
        """Prompt lengths whose one-sequence prefills meet every kernel variant that a step of 1 to
        max_tokens tokens picks (step_variants.warmup_token_counts, from this rank's weight shapes)."""
        model = self.runner.model
        layers = [*model.layers, *model.mtp]
        mods = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
        # not an LM head (an MTP layer holds one): its M is the sequences, not the tokens
        linears = {(*m.weight.shape, m.weight.dtype) for m in mods if not isinstance(m, ParallelLMHead)}
        moe = next((layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE)), None)
        shapes = StepShapes(
            sm_count(self.device),
            fp8_linears=tuple(sorted((n, k) for n, k, dtype in linears if dtype == FP8)),
            dense_linears=tuple(sorted((n, k) for n, k, dtype in linears if dtype in DENSE_DTYPES)),
            moe=None if moe is None else self._moe_shape(moe),
            fp8_cublas=any(m.cublas for m in mods),
        )
        return warmup_token_counts(shapes, max_tokens)

    def _moe_shape(self, moe: MoE) -> MoeShape:
        e, two_i, d = moe.w13.shape  # [E_local, 2I, D]
        top_k, fp8 = self.config.num_experts_per_tok, moe.w13_scale is not None
        return MoeShape(e, top_k, d, two_i // 2, fp8)

    # ---- requests ----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt | torch.Tensor) -> list[int]:
        """A string is encoded with bos prepended; token ids are taken as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MlacError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.tolist()]
        return [int(t) for t in prompt]

    def new_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Seq:
        """A validated request for a Scheduler (prompt in range, stop strings need a tokenizer,
        logit_bias in the vocabulary, no prompt_logprobs under speculative decoding, a grammar
        compiles: constrain.InvalidGrammar, whose `param` names response_format). `request_id`: the
        server's name of the request (its log lines)."""
        ids = self.encode_prompt(prompt)
        self._check_prompt(ids)
        if params.stop and self.tokenizer is None:
            raise MlacError("stop strings need a tokenizer; this engine has none")
        detok = self.tokenizer.detokenizer(ids) if self.tokenizer is not None else None
        check_logit_bias(params, self.config.vocab_size)
        check_prompt_logprobs(params, self.scheduler_config.speculative_num_steps)
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        generator = make_generator(params.seed, self.device)
        penalties = Penalties.of(params, ids, self.config.eos_token_ids)
        return Seq(next(self._seq_ids), ids, params, generator, detok, matcher, penalties=penalties,
                   request_id=request_id)  # fmt: skip

    def scheduler(self, config: SchedulerConfig | None = None) -> Scheduler:
        """A fresh continuous-batching scheduler over this engine's runner and cache."""
        return Scheduler(
            self.runner, self.config.eos_token_ids, self.max_context, config or self.scheduler_config
        )

    @staticmethod
    def _params(
        n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None, kwargs: dict
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams(**kwargs)] * n
        if kwargs:
            raise MlacError(f"give sampling_params or keyword arguments ({', '.join(kwargs)}), not both")
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        plist = list(sampling_params)
        if len(plist) != n:
            raise MlacError(f"{n} prompts but {len(plist)} SamplingParams")
        return plist

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs,
    ) -> Completion | list[Completion]:
        """Complete one prompt (-> Completion) or a batch of prompts (-> [Completion]) through the
        continuous-batching scheduler. Sampling comes from `sampling_params` (one for all, or one
        per prompt) or from SamplingParams keyword arguments (max_tokens=16, temperature=0.0 i.e.
        greedy, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs, presence_penalty,
        frequency_penalty, repetition_penalty, logit_bias, min_tokens, prompt_logprobs). A prompt
        that failed in the engine alone (Sequence.fail) raises MlacError once the others finished."""
        one = is_one_prompt(prompts)
        batch = [prompts] if one else list(prompts)
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in ("stop", "stop_token_ids")}
        plist = self._params(len(batch), sampling_params, kwargs)
        seqs = [self.new_sequence(p, sp) for p, sp in zip(batch, plist, strict=True)]
        sched = self.scheduler()
        for s in seqs:
            sched.add(s)
        try:
            while sched.has_unfinished:
                sched.step()
        finally:
            sched.abort_all()  # frees every block if a step failed
        failed = [(i, s.error) for i, s in enumerate(seqs) if s.error is not None]
        if failed:
            which = "" if one else f"prompt {failed[0][0]}: "
            raise MlacError(f"{which}the request failed in the engine: {failed[0][1]}")
        out = [self._completion(s) for s in seqs]
        return out[0] if one else out

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, **kwargs
    ) -> Iterator[Delta]:
        """Deltas of one request as it is generated (text held back while it could still be a stop
        string); the last delta carries finish_reason. Validation errors raise here, before the
        first delta. Closing the iterator early frees the request's blocks."""
        seq = self.new_sequence(prompt, self._params(1, sampling_params, kwargs)[0])
        sched = self.scheduler()
        sched.add(seq)
        return self._stream(sched, seq)

    @staticmethod
    def _stream(sched: Scheduler, seq: Seq) -> Iterator[Delta]:
        try:
            while not seq.finished:
                sched.step()
                if seq.error is not None:
                    raise MlacError(f"the request failed in the engine: {seq.error}")
                delta = seq.take_delta()
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield delta
        finally:
            sched.abort_all()

    @staticmethod
    def _completion(s: Seq) -> Completion:
        logprobs = list(s.logprobs) if s.params.logprobs is not None else None
        return Completion(s.text(), list(s.output_ids), s.finish_reason, len(s.prompt_ids), len(s.output_ids),
                          logprobs, s.prompt_logprobs)  # fmt: skip
