"""Engine: load an artifact, then score or generate (prefill, then decode step by step on the cache).

    engine = Engine.from_artifact("out/")
    engine.generate("Hello", max_tokens=32).text

A single-process reference engine: requests of one `generate_batch` call are prefilled together
and decoded together; continuous batching belongs to the scheduler, which drives the same
pieces (PagedKVCache, ForwardBatch, DeepseekModel, sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mlac.artifact import TOKENIZER_DIR, Manifest
from mlac.config import ModelConfig
from mlac.errors import MlacError
from mlac.runtime.kv_cache import ForwardBatch
from mlac.runtime.layers import Weights
from mlac.runtime.loader import to_compute_dtype
from mlac.runtime.model import DeepseekModel
from mlac.runtime.runner import LaunchSpec, ModelRunner, make_cache, make_runner
from mlac.runtime.sampling import SamplingParams, make_generator, sample
from mlac.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    text: str  # without eos / stop tokens, cut before a stop string
    token_ids: list[int]  # every generated token, the final eos / stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    block_table: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_at: int | None = None  # where a stop string starts in detok.text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Engine:
    """A model, its tokenizer and a paged KV cache on one device (one rank)."""

    def __init__(
        self,
        config: ModelConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None = None,
        manifest: Manifest | None = None,
    ):
        self.config = config
        self.runner = runner
        self.cache = runner.cache  # the block allocator (and capacity) the engine schedules with
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.device = runner.device

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_artifact(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        verify: bool = True,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
        launch: LaunchSpec | None = None,
    ) -> Engine:
        """Verify (sizes, and sha256 unless verify=False) and load an artifact; size the KV cache
        from `num_blocks`, else from `kv_cache_bytes` (default 1 GiB, capped at what four
        sequences of max_position_embeddings tokens need). `launch` says how the ranks of a
        multi-rank artifact find each other (see runner.make_runner)."""
        manifest = Manifest.load(path)
        runner = make_runner(path, manifest, device, dtype, verify, launch=launch, num_blocks=num_blocks,
                             kv_cache_bytes=kv_cache_bytes, block_size=block_size)  # fmt: skip
        tok_dir = Path(path) / TOKENIZER_DIR
        tokenizer = Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        return cls(manifest.model, runner, tokenizer, manifest)

    @classmethod
    def from_tensors(
        cls,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
    ) -> Engine:
        """An engine over in-memory tensors under mlac names (tests, tools); cast as the loader does."""
        tensors = {k: to_compute_dtype(k, t, dtype).to(device) for k, t in tensors.items()}
        model = DeepseekModel(config, Weights(tensors, source="tensors"))
        cache = make_cache(config, device, dtype, num_blocks, kv_cache_bytes, block_size)
        return cls(config, ModelRunner(model, cache), tokenizer)

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
        return min(self.config.max_position_embeddings, self.cache.capacity_tokens)

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
        if len(ids) > self.cache.capacity_tokens:
            raise MlacError(
                f"prompt of {len(ids)} tokens exceeds the KV cache ({self.cache.capacity_tokens} tokens)"
            )

    # ---- model steps -------------------------------------------------------------------------

    def _forward(
        self, tables: list[list[int]], ctx_lens: list[int], chunks: list[list[int]], every_token: bool = False
    ) -> torch.Tensor:
        """Run new tokens `chunks[i]` of each sequence after its ctx_lens[i] cached tokens.

        Returns float32 logits [sum(len), V] if every_token, else of each sequence's last token [B, V]."""
        batch = ForwardBatch.build(
            ctx_lens, [len(c) for c in chunks], tables, self.cache.block_size, self.device
        )
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        return self.runner.forward(ids, batch, every_token)

    def score(self, token_ids: Sequence[int] | torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [T, V] float32 of every position (prefill, in chunks if asked)."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        self._check_prompt(ids)
        step = chunk_size or len(ids)
        table: list[int] = []
        try:
            self.cache.allocator.reserve(table, len(ids))
            out = [
                self._forward([table], [s], [ids[s : s + step]], every_token=True)
                for s in range(0, len(ids), step)
            ]
        finally:
            self.cache.allocator.free(table)
        return torch.cat(out)

    # ---- generation --------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A string is encoded with bos prepended; a list of token ids is taken as it is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MlacError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> Completion:
        """Complete one prompt (greedy when temperature == 0)."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop or (),
            stop_token_ids=stop_token_ids or (),
            ignore_eos=ignore_eos,
        )
        return self.generate_batch([prompt], params)[0]

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Complete several prompts together: one prefill over all, then batched decode steps."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise MlacError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [self._new_request(self.encode_prompt(p), sp) for p, sp in zip(prompts, plist, strict=True)]
        try:
            self._reserve(reqs)
            logits = self._forward(
                [r.block_table for r in reqs], [0] * len(reqs), [r.prompt_ids for r in reqs]
            )
            self._append(reqs, logits)
            while active := [r for r in reqs if r.finish_reason is None]:
                tables = [r.block_table for r in active]
                logits = self._forward(
                    tables, [r.num_tokens - 1 for r in active], [[r.output_ids[-1]] for r in active]
                )
                self._append(active, logits)
        finally:
            for r in reqs:
                self.cache.allocator.free(r.block_table)
        return [self._completion(r) for r in reqs]

    def _new_request(self, ids: list[int], params: SamplingParams) -> _Request:
        self._check_prompt(ids)
        if params.stop and self.tokenizer is None:
            raise MlacError("stop strings need a tokenizer; this engine has none")
        detok = self.tokenizer.detokenizer(ids) if self.tokenizer is not None else None
        return _Request(ids, params, make_generator(params.seed, self.device), detok)

    def _reserve(self, reqs: list[_Request]) -> None:
        """Blocks for each request's whole run up front (admission; no failure mid-generation)."""
        alloc = self.cache.allocator
        need = [min(r.num_tokens + r.params.max_tokens, self.max_context) for r in reqs]
        blocks = sum(alloc.blocks_for(n) for n in need)
        if blocks > alloc.num_free:
            raise MlacError(f"KV cache too small: {blocks} blocks needed, {alloc.num_free} free")
        for r, n in zip(reqs, need, strict=True):
            alloc.reserve(r.block_table, n)

    def _append(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request from its logits [B, V]; decide which requests finish."""
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        eos = set(self.config.eos_token_ids)
        for r, t in zip(reqs, tokens, strict=True):
            r.output_ids.append(t)
            p = r.params
            if t in p.stop_token_ids or (not p.ignore_eos and t in eos):
                r.finish_reason = "stop"  # the stop token's text is not part of the completion
                continue
            new = r.detok.add(t) if r.detok is not None else ""
            if new and p.stop:
                r.stop_at = find_stop(r.detok.text, len(new), p.stop)
            if r.stop_at is not None:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_context:
                r.finish_reason = "length"

    def _completion(self, r: _Request) -> Completion:
        if r.detok is None:
            text = ""
        elif r.stop_at is not None:
            text = r.detok.text[: r.stop_at]
        else:
            r.detok.flush()
            text = r.detok.text
        return Completion(text, list(r.output_ids), r.finish_reason, len(r.prompt_ids), len(r.output_ids))


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text`, looking only where the last `new_chars`
    characters could have completed one (a stop string may straddle tokens)."""
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None
