"""The sampler: greedy, temperature, top-k, top-p, min-p, and log-probabilities with top alternatives,
as each row's SamplingParams (params.py) say. The penalties, logit_bias and min_tokens change a
row's logits before all of this (penalties.py).

Each request may carry a seed: its own torch.Generator then makes the same request give the same
tokens whatever else shares the batch (a row's filters and its draw depend only on its own logits
and generator).

Logprobs are those of the model's distribution (log_softmax of the raw logits, before temperature
and the filters), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlac.kernels.top_p import nucleus_cut, top_p_filter, top_p_filter_ref
from mlac.runtime.device_copy import to_device
from mlac.runtime.engine.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int | None = None  # of token_id in its distribution, 1 the most likely (prompt logprobs)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits [B, V], top_k [B] (0 = off) -> logits with all but each row's k largest at -inf."""
    v = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], top_p [B] -> keep the smallest set of most likely tokens with mass >= top_p, and
    the tokens exactly as likely as the last one kept (kernels/top_p.py's rule, by a sort)."""
    return top_p_filter_ref(logits, top_p)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], min_p [B] -> drop tokens less likely than min_p x the row's most likely one."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


TOP_K_CANDIDATES = 1024  # top-k by torch.topk up to this k (and top-p among its candidates); a sort above


def filter_rows(x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """x [R, V] float32 logits (after temperature), each row's top_k (0: off) and top_p (1: off) as
    host values -> x with the filtered tokens at -inf, as apply_top_k then apply_top_p would leave it.

    Only what some row asks for runs: nothing where every row keeps every token (top_k 0, top_p 1:
    OpenAI's defaults). Top-k takes the k largest by torch.topk at the batch's largest k up to
    TOP_K_CANDIDATES, and top-p then works among those candidates when every row that asks for it
    also asks for a top-k (the tokens outside are at -inf: probability 0, nothing to sort). Else
    top-p runs over its rows' whole vocabulary: kernels/top_p.py's search on CUDA (no sort), the
    sort on CPU. Ties at a top-k cut fall as torch.topk orders them; ties at a top-p cut are kept."""
    v = x.shape[-1]
    ks = [int(k) if 0 < k < v else 0 for k in top_k]  # a k of V or more keeps every token: off
    p_rows = [j for j, p in enumerate(top_p) if p < 1.0]
    cand = None  # (values, indices) [R, kmax]: each row's largest, descending
    if any(ks):
        kmax = max(ks)
        k_dev = to_device([k or kmax for k in ks], torch.int64, x.device)  # [R]; off: the last candidate
        if kmax <= TOP_K_CANDIDATES:
            cand = x.topk(kmax, dim=-1)
            kth = cand.values.gather(1, (k_dev - 1)[:, None])  # [R, 1]
        else:
            kth = x.sort(dim=-1, descending=True).values.gather(1, (k_dev - 1)[:, None])
        off = to_device([k == 0 for k in ks], torch.bool, x.device)[:, None]
        x = x.masked_fill((x < kth) & ~off, float("-inf"))
    if not p_rows:
        return x
    if cand is not None and all(ks[j] > 0 for j in p_rows):
        values = cand.values.masked_fill(cand.values < kth, float("-inf"))  # beyond each row's k
        cut = nucleus_cut(values, to_device(list(top_p), torch.float32, x.device))  # -inf: top_p 1
        return x.masked_fill(x < cut, float("-inf"))
    rows = None if len(p_rows) == len(top_p) else to_device(p_rows, torch.int64, x.device)
    sub = x if rows is None else x.index_select(0, rows)
    p_sub = to_device([top_p[j] for j in p_rows], torch.float32, x.device)
    sub = top_p_filter(sub, p_sub)
    return sub if rows is None else x.index_copy(0, rows, sub)


NOT_A_DISTRIBUTION = "the probabilities hold inf, nan or a negative value, or sum to 0"


def draw(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] -> (one token id per row [R] int64, whether the row is a distribution [R] bool),
    both on the device, nothing waited for. The exponential race that torch.multinomial runs for one
    sample (argmax of probs / q, q ~ Exp(1)), all rows in one launch. A seeded row's q comes from its
    own generator, drawn as torch.multinomial(probs[j], 1, generator=g) draws it: the same token,
    whatever shares the batch. Unseeded rows share one draw of the global generator. A row that is no
    distribution (NaN, inf, negative, all zero: what torch.multinomial refuses, waiting twice per row
    to find out) gets a placeholder id and False."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for j, g in enumerate(generators):
        if g is not None:  # a fresh [V] draw, as torch.multinomial's own (then the row's copy)
            q[j].copy_(torch.empty_like(probs[j]).exponential_(generator=g))
    ok = (probs >= 0).all(dim=-1) & (probs < float("inf")).all(dim=-1) & (probs.sum(dim=-1) > 0)
    return (probs / q).argmax(dim=-1), ok


def sample_deferred(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] float32, one SamplingParams and generator per row -> (token ids [B] int64, and
    `bad` [B] bool: the rows whose probabilities were no distribution, their ids placeholders; None
    where no row samples), on the logits' device, nothing waited for. Greedy rows take the argmax;
    the others, together: temperature, top-k, top-p (filter_rows), min-p, softmax and one draw
    (draw), a fixed number of launches whatever B. Raises only for what the host sees (the
    arguments)."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(
            f"sample: {logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
        )
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out, None
    dev = logits.device

    def per_row(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device([getattr(params[i], name) for i in rows], dtype, dev)

    picked = to_device(rows, torch.int64, dev)
    x = logits if len(rows) == len(params) else logits.index_select(0, picked)
    x = x.float() / per_row("temperature")[:, None]  # [R, V]; temperature >= GREEDY_BELOW here
    x = filter_rows(x, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
    if any(params[i].min_p > 0 for i in rows):
        x = apply_min_p(x, per_row("min_p"))
    ids, ok = draw(x.softmax(dim=-1), [generators[i] for i in rows])
    bad = torch.zeros(len(params), dtype=torch.bool, device=dev).index_copy(0, picked, ~ok)
    return out.index_copy(0, picked, ids), bad


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """sample_deferred's token ids [B], checked: ValueError naming the rows whose probabilities were
    no distribution (one wait for the device, where some row samples)."""
    ids, bad = sample_deferred(logits, params, generators)
    if bad is not None and bool(bad.any()):
        raise ValueError(f"rows {bad.nonzero().flatten().tolist()}: {NOT_A_DISTRIBUTION}")
    return ids


def sample_apart(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    deferred: bool = False,
) -> tuple[torch.Tensor, dict[int, Exception], torch.Tensor | None]:
    """As `sample`, but one row's failure does not fail the others: token ids [B], the rows whose
    draw raised with their errors (their id is the row's argmax: a placeholder the caller drops),
    and with `deferred` the device mask of rows that were no distribution (sample_deferred: the
    caller fails them when it reads the ids; None otherwise, those rows then among the errors).
    The rows go together; only if that raises does each go alone, each seeded generator first
    rewound to where it was (a row draws what it would have drawn without the failure)."""
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        if deferred:
            ids, bad = sample_deferred(logits, params, generators)
            return ids, {}, bad
        return sample(logits, params, generators), {}, None
    except Exception:  # noqa: BLE001  (one row's: found below, row by row)
        for g, state in zip(generators, states, strict=True):
            if state is not None:
                g.set_state(state)
    ids, errors = [], {}
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        try:
            ids.append(sample(logits[i : i + 1], [p], [g]))
        except Exception as e:  # noqa: BLE001  (this row's failure: its request's error)
            errors[i] = e
            ids.append(logits[i : i + 1].argmax(dim=-1))
    return torch.cat(ids), errors, None


def logprob_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device half of token_logprobs: (values [R, 1 + k] float32, ids [R, 1 + k] int64) on the
    logits' device for the R rows that asked (column 0 the sampled token, then the k most likely,
    k the most any row asked); None when no row asked. Nothing here waits for the device."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return None
    index = to_device(rows, torch.int64, logits.device) if len(rows) < len(num_top) else None
    x = logits if index is None else logits.index_select(0, index)
    ids = token_ids.to(logits.device)[:, None]  # [B, 1]
    ids = ids if index is None else ids.index_select(0, index)  # [R, 1]
    lp = torch.log_softmax(x.float(), dim=-1)  # [R, V]
    k = max(num_top[i] for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], ids[:, :0])  # [R, k]
    return torch.cat([lp.gather(1, ids), top_vals], dim=1), torch.cat([ids, top_ids], dim=1)


def read_logprobs(
    vals: list[list[float]], ids: list[list[int]], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """The host half of token_logprobs: logprob_tensors' rows (as lists) -> each row's
    TokenLogprob (None where not asked)."""
    out: list[TokenLogprob | None] = [None] * len(num_top)
    rows = [i for i, n in enumerate(num_top) if n is not None]
    for j, i in enumerate(rows):
        n = num_top[i]
        top = tuple(zip(ids[j][1 : 1 + n], vals[j][1 : 1 + n], strict=True))
        out[i] = TokenLogprob(ids[j][0], vals[j][0], top)
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """logits [B, V], the sampled token_ids [B], alternatives wanted per row (None: no logprobs)
    -> each row's TokenLogprob (None where not asked). The rows that asked are computed together
    on the logits' device; two transfers to the host in all (values and ids), none per row."""
    found = logprob_tensors(logits, token_ids, num_top)
    if found is None:
        return [None] * len(num_top)
    vals, ids = found
    return read_logprobs(vals.tolist(), ids.tolist(), num_top)
