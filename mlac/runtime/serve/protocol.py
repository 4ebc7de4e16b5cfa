"""The OpenAI request bodies (pydantic, strict types) and their validation; OpenAI's error shape.

Types are strict: `"max_tokens": "10"` or `"stream": "yes"` is a 400, not coerced (an int is
still accepted where a float is expected). Limits that the models cannot state:

    stop          at most MAX_STOP_STRINGS strings, MAX_STOP_CHARS characters in all
    messages      at most MAX_MESSAGES; content parts of type "text" only (a 400 naming the part)
    prompts       at most `max_unfinished` (--max-running-requests + --max-queue) choices (prompts
                  times n) in one request: more could never be admitted

Structured output: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}} and vLLM's guided_* fields and `structured_outputs` become a
GrammarSpec (guided.py); a grammar that does not compile is a 400 naming its field (raised by the
engine: constrain.InvalidGrammar).

Sampling fields as vLLM's (SamplingParams checks them again): presence and frequency penalties in
[-2, 2], repetition_penalty > 0, logit_bias {"token id": bias in [-100, 100]} (ids in the
vocabulary), min_tokens <= max_tokens, prompt_logprobs in [0, 20]; `echo` on completions (with
max_tokens 0: the prompt only, scored) and on chat (the final assistant message's content first);
truncate_prompt_tokens >= 1 or -1; continue_final_message not with add_generation_prompt true.
Fields that mlac does not implement (UNSUPPORTED_EXTRAS: beam search, ...) are a 400 naming the
field unless they hold their neutral value: never a silent 200.
    prompt + max_tokens   within the engine's context
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlac.runtime.engine.generation_config import SamplingDefaults
from mlac.runtime.engine.params import (
    MAX_LOGPROBS,
    GrammarSpec,
    InvalidGrammar,
    InvalidSamplingParams,
    SamplingParams,
)
from mlac.runtime.engine.sequence import Sequence
from mlac.runtime.serve.guided import GuidedError, StructuredOutputs, grammar_of

MAX_N = 16  # choices of one request (n); each is one engine request
MAX_STOP_STRINGS = 64  # OpenAI allows 4, vLLM has no limit; 300,000 of them slowed every request 5-7x
MAX_STOP_CHARS = 8192  # over all stop strings of a request
MAX_MESSAGES = 2048  # of a chat (OpenAI's limit)


class ApiError(Exception):
    """An error answered in OpenAI's shape, with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the output must match (`strict` is implied: the
    schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Bias = Annotated[float, Field(ge=-100, le=100)]


class Body(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Bias] | None = None  # {"token id": bias}
    user: str | None = None
    # extensions, as vLLM names them
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    # prompt tokens kept, the last ones (-1: the model's context); None: all
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None  # bos: completions true (a text prompt), chat false
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None  # Lark, llguidance's syntax
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(Body):
    # token ids first: a list of ids matches it at once (after list[str], smart mode also tried that,
    # an error per id: 0.8 ms for 2,000 ids, on the way to every prompt's first token)
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo only (the prompt, scored)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a function (tool_choice.py)
    parallel_tool_calls: bool | None = None  # false: a forced answer makes one call
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"thinking": true}
    documents: list[dict[str, Any]] | None = None  # a template variable (RAG templates read it)
    add_generation_prompt: bool | None = None  # None: true, unless continue_final_message
    continue_final_message: bool = False  # the final message left open: the model continues it
    echo: bool = False  # the answer starts with the final message's content when it is an assistant's


class TokenizeBody(BaseModel):
    """vLLM's /tokenize request: a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    tokens: list[int]


def generation_prompt(body: ChatBody | TokenizeBody) -> bool:
    """Whether the chat template adds the generation prompt: as asked, else unless the final
    message is continued (both true is a 400: parse_body)."""
    if body.add_generation_prompt is None:
        return not body.continue_final_message
    return body.add_generation_prompt


def chat_messages(body: ChatBody | TokenizeBody) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: every field given (tool_calls, tool_call_id,
    name, ...), content as text, and a null content kept null (an assistant turn of tool calls)."""
    return [
        {**m.model_dump(exclude_none=True), "content": message_text(m.content, f"messages[{i}].content")}
        for i, m in enumerate(body.messages)
    ]


UNSUPPORTED = {
    "best_of": "only best_of=1 is supported",
    "suffix": "suffix is not supported",
}
# Fields no model above declares, each with its neutral values (null is always neutral): any other
# value is a 400 naming the field. OpenAI's first, then vLLM's. Fields that change nothing mlac
# computes are ignored instead (docs/serving.md lists them): metadata (user, metadata, store,
# request_id, session_id), the media fields of multimodal inputs (mm_processor_kwargs,
# media_io_kwargs: content parts are text only), how output is batched or rendered elsewhere
# (stream_interval, return_token_offsets, return_mm_kwargs), guided_decoding_backend (the same
# constraint, llguidance's), and spaces_between_special_tokens (special tokens are skipped).
UNSUPPORTED_EXTRAS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,),
    "early_stopping": (False,),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "include_reasoning": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logprob_token_ids": (),
    "logits_processors": ([],),
    "truncation_side": ("left",),  # truncate_prompt_tokens keeps the last tokens
    "thinking_token_budget": (-1,),
    "repetition_detection": (),
    "watermarking": (False,),
    "prompt_embeds": (),
    "chat_template": (),
    "priority": (0,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": ({},),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_prompt_text": (False,),
}


def check_extras(data: Any) -> None:
    """400 naming the first field of UNSUPPORTED_EXTRAS that `data` sets to a non-neutral value."""
    if not isinstance(data, dict):
        return
    for name, neutral in UNSUPPORTED_EXTRAS.items():
        value = data.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise ApiError(400, f"{name} is not supported", param=name)


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """`data` (a parsed JSON object) as `model`; ApiError 400 naming the first bad field."""
    check_extras(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        top = str(err["loc"][0]) if err["loc"] else ""
        message = UNSUPPORTED.get(top) or (f"{param}: {err['msg']}" if param else err["msg"])
        raise ApiError(400, message, param=param) from None
    if getattr(body, "suffix", None):
        raise ApiError(400, UNSUPPORTED["suffix"], param="suffix")
    if getattr(body, "max_tokens", None) == 0 and not getattr(body, "echo", False):
        raise ApiError(
            400, "max_tokens: 0 is only allowed with echo (the prompt, scored)", param="max_tokens"
        )
    if getattr(body, "continue_final_message", False) and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message: cannot be true with add_generation_prompt true "
                       "(continue the final message, or start a new one)", param="continue_final_message")  # fmt: skip
    if getattr(body, "truncate_prompt_tokens", None) == 0:
        raise ApiError(400, "truncate_prompt_tokens: must be >= 1 (or -1: the model's context)",
                       param="truncate_prompt_tokens")  # fmt: skip
    if (getattr(body, "stream_options", None) or {}).get("continuous_usage_stats"):
        raise ApiError(400, "stream_options.continuous_usage_stats is not supported",
                       param="stream_options.continuous_usage_stats")  # fmt: skip
    check_stop(getattr(body, "stop", None))
    return body


def check_stop(stop: str | list[str] | None) -> None:
    """At most MAX_STOP_STRINGS stop strings of MAX_STOP_CHARS characters in all."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"stop: {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop"
        )
    chars = sum(len(s) for s in stops)
    if chars > MAX_STOP_CHARS:
        raise ApiError(
            400, f"stop: {chars} characters in all; at most {MAX_STOP_CHARS} are allowed", param="stop"
        )


def sampling_params(
    body: Body,
    max_tokens: int,
    logprobs: int | None,
    defaults: SamplingDefaults,
    choice: int = 0,
    tool_grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """The SamplingParams of one choice: the body's fields, `defaults` (--generation-config) where
    the body leaves one out. Choice j > 0 of a seeded request samples with seed + j (n different
    choices, the same ones for the same seed). `tool_grammar` (tool_choice required or a named
    function) constrains the output instead of response_format; both at once are a 400."""
    pick = {f: getattr(defaults, f) if getattr(body, f) is None else getattr(body, f) for f in DEFAULTED}
    found = grammar_spec(body)
    grammar = found[1] if found is not None else None
    if tool_grammar is not None:
        if found is not None:
            raise ApiError(400, f"{found[0]} cannot be combined with tool_choice "
                           '"required" or a named function', param="tool_choice")  # fmt: skip
        grammar = tool_grammar
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick["temperature"],
            top_p=pick["top_p"],
            top_k=max(0, pick["top_k"]),
            min_p=pick["min_p"],
            seed=None if body.seed is None else body.seed + choice,
            stop=body.stop or (),
            stop_token_ids=body.stop_token_ids or (),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            grammar=grammar,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias(body.logit_bias),
            min_tokens=body.min_tokens,
            prompt_logprobs=prompt_logprobs(body, logprobs),
        )
    except InvalidSamplingParams as e:
        raise ApiError(400, str(e), param=e.param) from None


DEFAULTED = ("temperature", "top_p", "top_k", "min_p")  # fields --generation-config can default


def logit_bias(given: dict[str, float] | None) -> dict[int, float]:
    """{token id: bias} of a body's logit_bias (JSON keys are strings); 400 for a key that is not one."""
    try:
        return {int(k): v for k, v in (given or {}).items()}
    except ValueError:
        bad = next(k for k in given if not k.strip().lstrip("-").isdigit())
        raise ApiError(400, f"logit_bias: {bad!r} is not a token id", param="logit_bias") from None


def prompt_logprobs(body: Body, logprobs: int | None) -> int | None:
    """The prompt logprobs a request needs: prompt_logprobs, and with echo, as many alternatives
    as its logprobs (the echoed prompt's tokens are scored too)."""
    asked = body.prompt_logprobs
    if isinstance(body, CompletionBody) and body.echo and logprobs is not None:
        return max(asked or 0, logprobs)
    return asked


def grammar_spec(body: Body) -> tuple[str, GrammarSpec] | None:
    """(field, grammar) of the request's structured-output field (guided.py; None: free text); a
    400 naming the field for two of them, or a json_schema format without its schema."""
    try:
        return grammar_of(body)
    except GuidedError as e:
        raise ApiError(400, str(e), param=e.param) from None


def message_text(content: str | list[dict[str, Any]] | None, where: str) -> str | None:
    """A message's content as text: a string, None, or the text parts of a content list; a part
    of another type (an image, audio) is a 400 whose param names it, as OpenAI's: `where` (the
    content's path, "messages[0].content") + "[1].type"."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise ApiError(400, f"{where}[{j}].type: content parts of type {kind!r} are not supported "
                           "(only 'text')", param=f"{where}[{j}].type")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}].text: must be a string", param=f"{where}[{j}].text")
        parts.append(part["text"])
    return "".join(parts)


def truncate_prompt(ids: list[int], body: Body, context: int) -> list[int]:
    """The prompt tokens that run: the last `truncate_prompt_tokens` (-1: `context`), else all."""
    keep = body.truncate_prompt_tokens
    keep = context if keep == -1 else keep
    return ids if keep is None or keep >= len(ids) else ids[len(ids) - keep :]


def prompt_list(prompt: str | list, limit: int, n: int = 1) -> list[str | list[int]]:
    """The prompts of a completion request (n choices each), at most `limit` choices in all."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    elif not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    else:
        prompts = list(prompt)
    check_choices(len(prompts), n, limit, "prompt")
    return prompts


def check_choices(prompts: int, n: int, limit: int, what: str) -> None:
    """400 when `prompts` x `n` choices could never be queued or running at once (`limit`)."""
    if prompts * n > limit:
        raise ApiError(
            400,
            f"{what}: {prompts} prompt(s) x n={n} choices in one request; at most {limit} can be queued "
            "or running at once (--max-running-requests + --max-queue)",
            param="n" if prompts == 1 else what,
        )


def new_sequences(
    engine,
    ids: list[int],
    body: Body,
    max_tokens: int,
    logprobs: int | None,
    what: str,
    defaults: SamplingDefaults,
    tool_grammar: GrammarSpec | None = None,
    request_id: str | None = None,
) -> list[Sequence]:
    """The body.n engine requests (choices) for prompt `ids`, named `request_id` (choice j of n >
    1: "<request_id>-j"); 400 if prompt + max_tokens exceed the context. Each choice is its own
    engine request; with the prefix cache they share the prompt's prefill (the scheduler admits
    the others once the first has cached the prompt).
    `tool_grammar`: see sampling_params (a tool's parameters schema that does not compile is a 400
    naming `tools`)."""
    ctx = engine.max_context
    if len(ids) + max_tokens > ctx:
        raise ApiError(
            400,
            f"this model's maximum context length is {ctx} tokens; you requested {len(ids) + max_tokens} "
            f"({len(ids)} in the {what}, {max_tokens} for the completion): shorten the {what} or max_tokens",
            param=what,
            code="context_length_exceeded",
        )
    try:
        names = [
            request_id if body.n == 1 or request_id is None else f"{request_id}-{j}" for j in range(body.n)
        ]
        return [
            engine.new_sequence(
                ids, sampling_params(body, max_tokens, logprobs, defaults, j, tool_grammar), name
            )
            for j, name in enumerate(names)
        ]
    except InvalidGrammar as e:
        found = grammar_spec(body)
        field = "tools" if tool_grammar is not None else found[0] if found is not None else e.param
        raise ApiError(400, f"{field}: {str(e).removeprefix('response_format: ')}", param=field) from None
    except InvalidSamplingParams as e:
        raise ApiError(400, str(e), param=e.param) from None
