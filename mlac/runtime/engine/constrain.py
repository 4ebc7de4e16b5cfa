"""Structured output: grammar-constrained sampling through llguidance.

A request's SamplingParams may carry a GrammarSpec: a JSON schema, any JSON object, a regular
expression (the whole output matches it), or a Lark grammar (which may embed JSON schemas as
`%json{...}`). The engine's Grammars compiles each
distinct spec once (a small LRU) and gives every sequence its own Matcher, a copy of the compiled
one. Each step, `mask_logits` computes on the CPU the tokens each constrained row may take next
(one bit per token) and sets the others to -inf on the logits' device; after sampling, the
sequence's matcher consumes the token, and the sequence finishes once its grammar is complete
(as if it had sampled eos).

llguidance is imported, and its view of the tokenizer built (about a second for a 128k
vocabulary), on the first constrained request: a server that never gets one pays nothing.

JSON is generated in one canonical layout, `{"a": 1, "b": [true, false]}` (JSON_OPTIONS): no free
whitespace, so that a weak or random model cannot spend its tokens on blanks. A schema may ask for
other separators or free whitespace with llguidance's "x-guidance" key (for example
`{"x-guidance": {"whitespace_flexible": true}, ...}`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.params import GrammarSpec, InvalidGrammar

if TYPE_CHECKING:
    from mlac.runtime.engine.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object
MAX_ERROR_CHARS = 400  # of llguidance's message in a 400


class GrammarFailed(MlacError):
    """llguidance stopped following a sequence's grammar (its matcher went into error): that
    request fails, alone."""


def _first_line(error: str) -> str:
    """llguidance's error without the state dump that follows its first line."""
    return error.strip().splitlines()[0][:MAX_ERROR_CHARS] if error.strip() else "unknown error"


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (not compiled yet); InvalidGrammar when the schema is not
    a JSON object."""
    from llguidance import LLMatcher

    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    source = spec.source if spec.kind == "json_schema" else ANY_OBJECT
    try:
        schema = json.loads(source)
    except ValueError as e:
        raise InvalidGrammar(f"response_format: the JSON schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidGrammar(
            f"response_format: the JSON schema must be an object, not {type(schema).__name__}"
        )
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


class Matcher:
    """One sequence's place in its grammar: the tokens allowed next, and the tokens taken so far.

    A preempted sequence keeps its matcher: it has consumed exactly the sequence's output tokens,
    which recomputation does not change."""

    def __init__(self, matcher: Any, executor: Any, mask_words: int):
        self._m = matcher  # llguidance.LLMatcher
        self._executor = executor  # llguidance.LLExecutor shared by the engine's matchers
        self.mask_words = mask_words  # int32 words of one mask: ceil(llguidance's vocabulary / 32)

    def advance(self, token: int) -> None:
        """Take a sampled token; GrammarFailed if that leaves the matcher in error (a token the
        grammar forbids: it was masked, so only a caller that bypassed the mask can do it)."""
        self._m.consume_token(token)
        self.check()

    def check(self) -> None:
        """GrammarFailed if llguidance put the matcher in error (consuming a token, or computing
        its mask: a grammar that allows nothing more, say)."""
        if self._m.is_error():
            raise GrammarFailed(f"the grammar failed: {_first_line(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing but eos may follow), or the matcher failed."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (eos may follow)."""
        return self._m.is_accepting()


class Grammars:
    """One engine's compiled grammars: llguidance's view of its tokenizer (built on first use),
    compiled specs in an LRU of `capacity`, and a thread pool for the masks. Thread-safe: the
    server compiles in request threads while the engine thread computes masks.

    The masks cover max(`vocab_size` (the logits' columns), the tokenizer's ids); ids that the
    tokenizer lacks (padding of the embedding) are never allowed."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: Sequence[int], capacity: int = 32
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_ids)
        self._capacity = capacity
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._lltok = self._executor = None

    def _lltokenizer(self):
        """llguidance's tokenizer and thread pool, made on first use (under the lock)."""
        if self._lltok is None:
            import llguidance

            tok = self._tokenizer
            if tok is None:
                raise InvalidGrammar("structured output needs the model's tokenizer; this engine has none")
            n_vocab = max(self.vocab_size, tok.vocab_size)
            eos = self._eos or None  # none given: the tokenizer's own
            self._lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=n_vocab, eos_token=eos)
            self._executor = llguidance.LLExecutor()
        return self._lltok

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher at the start of `spec` (compiled once, then copied); InvalidGrammar when
        the spec does not compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None:
                compiled = self._compile(spec)
                self._compiled[spec] = compiled
                if len(self._compiled) > self._capacity:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
            return Matcher(compiled.deep_copy(), self._executor, (self._lltok.vocab_size + 31) // 32)

    def _compile(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        tok = self._lltokenizer()
        m = LLMatcher(tok, llguidance_grammar(spec), log_level=0)
        if m.is_error():
            why = m.get_error().strip()[:MAX_ERROR_CHARS]
            raise InvalidGrammar(f"response_format: cannot compile the {spec.kind} grammar: {why}")
        self._check_start(m, spec)
        return m

    def _check_start(self, compiled, spec: GrammarSpec) -> None:
        """InvalidGrammar when the grammar allows no first token: a schema that compiles but
        matches nothing (`{"$ref": "#"}`) puts its matcher in error at its first mask."""
        probe = Matcher(compiled.deep_copy(), self._executor, (self._lltok.vocab_size + 31) // 32)
        token_bitmask([probe], check=False)
        if probe._m.is_error():
            why = _first_line(probe._m.get_error())
            raise InvalidGrammar(f"response_format: the {spec.kind} grammar matches no output ({why})")


def mask_logits(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """logits [B, V], one matcher per row (None: unconstrained) -> `logits` itself when no row is
    constrained, else a copy in which every token a row's grammar forbids is -inf. The bitmask is
    computed on the CPU (in parallel over rows), copied to the logits' device and unpacked there."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bits = token_bitmask([matchers[i] for i in rows])  # [R, W]
    allowed = unpack_bits(bits.to(logits.device), logits.shape[1])  # [R, V]
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def token_bitmask(matchers: Sequence[Matcher], check: bool = True) -> torch.Tensor:
    """[R, W] int32 on the CPU: bit k of word w of row r is set when matchers[r] allows token
    32w + k next. The rows are filled in parallel (llguidance's executor drops the GIL). With
    `check`, GrammarFailed if a matcher went into error (the caller retries the rows alone)."""
    bits = torch.zeros(len(matchers), matchers[0].mask_words, dtype=torch.int32)
    pairs = [(m._m, r) for r, m in enumerate(matchers)]
    matchers[0]._executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])
    for m in matchers if check else ():
        m.check()
    return bits


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab] bool (on bits' device; the words past vocab are dropped)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
