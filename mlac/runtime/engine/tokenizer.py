"""The artifact's tokenizer: `tokenizers` for the vocabulary, jinja2 (sandboxed) for chat templates.

Reads artifact/tokenizer/tokenizer.json and tokenizer_config.json (bos/eos tokens, add_bos_token,
chat_template) and chat_template.jinja (where transformers 5 saves a template; it wins over the
config's, as in transformers). Prompts are encoded with bos prepended, as DeepSeek's tokenizers do;
chat prompts are not (the template writes bos itself), so bos appears exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from mlac.core.errors import MlacError
from mlac.core.jsonio import load_json


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _config_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the
    "default" one is used, as transformers does)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


def read_chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
    """`root`/chat_template.jinja if present, else tokenizer_config.json's chat_template."""
    jinja = root / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return _config_template(cfg.get("chat_template"))


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter (jinja2's escapes HTML characters; templates expect it not to)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str):
    """A chat template compiled in the environment transformers renders templates in."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class FinalMessageNotFound(MlacError, ValueError):
    """continue_final_message: the final message's content is not in the rendered chat (the
    template dropped or rewrote it), or there is none to continue."""


def cut_after_final(text: str, content: str | None) -> str:
    """`text` (a chat rendered without a generation prompt) cut right after the last occurrence of
    the final message's `content`: the end-of-turn the template wrote after it goes, and the model
    continues that message. A template that trims the content is matched by the trimmed text."""
    if not content or not content.strip():
        raise FinalMessageNotFound("the final message has no content to continue")
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise FinalMessageNotFound(
        "the final message's content does not appear in the chat as the template renders it"
    )


def _load_tokenizer_json(path: Path):
    """The `tokenizers` Tokenizer of tokenizer.json; a file it cannot parse is an MlacError naming it."""
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise MlacError(f"{path}: tokenizer.json not found")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception for a corrupt file
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise MlacError(f"{path}: corrupt tokenizer file ({why})") from None


class Tokenizer:
    """Reads `path`/tokenizer.json and, if present, `path`/tokenizer_config.json and
    `path`/chat_template.jinja; a corrupt file is an MlacError naming it."""

    def __init__(self, path: str | Path):
        root = Path(path)
        self._tok = _load_tokenizer_json(root / "tokenizer.json")
        cfg_file = root / "tokenizer_config.json"
        cfg = load_json(cfg_file.read_bytes(), str(cfg_file)) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.add_bos = bool(cfg.get("add_bos_token", True)) and self.bos_token_id is not None
        named = {k: _token_text(v) for k, v in cfg.items() if k.endswith("_token")}
        self.special_tokens = {k: v for k, v in named.items() if isinstance(v, str)}  # template variables
        self.chat_template: str | None = read_chat_template(root, cfg)
        self._template = None
        self._token_texts: dict[int, str] = {}  # token_text's answers (at most the vocabulary)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """tokenizer.json's content (as `tokenizers` serializes it: grammar libraries read it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with bos prepended unless add_bos=False (or the tokenizer has none)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (logprobs). A token that holds part
        of a UTF-8 character shows as U+FFFD. Remembered: streamed logprobs ask for every token."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def use_chat_template(self, path: str | Path) -> None:
        """Render chats with the template in file `path` (`--chat-template`) instead of the artifact's."""
        file = Path(path)
        if not file.is_file():
            raise MlacError(f"--chat-template {file}: no such file")
        self.chat_template, self._template = file.read_text(encoding="utf-8"), None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages with the template as transformers' apply_chat_template does:
        sandboxed jinja2, the special tokens (bos_token, eos_token, ...), `tools`, and
        `template_kwargs` (a request's chat_template_kwargs, e.g. thinking=True) as variables.
        `continue_final_message`: the final message is left open (rendered without a generation
        prompt, cut after its content: cut_after_final), for the model to continue; with
        `add_generation_prompt` it is a ValueError, as in transformers.
        A template that refuses the messages raises jinja2's TemplateError."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.chat_template is None:
            raise MlacError("this artifact's tokenizer has no chat_template")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        fixed = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        text = self._template.render({"bos_token": "", "eos_token": "", **self.special_tokens, **template_kwargs,
                                      **fixed})  # fmt: skip
        return cut_after_final(text, messages[-1].get("content")) if continue_final_message else text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Chat prompt ids. Templates write bos themselves, so none is prepended here (bos once)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message,
                                        **template_kwargs)  # fmt: skip
        return self.encode(text, add_bos=False)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Text of a growing completion, emitted as it becomes stable (for streaming and stop strings).

    Each step decodes a few already-emitted tokens together with the new ones, so that decoders
    that depend on neighbours (byte-level BPE, sentencepiece spaces) come out right, and holds
    text back while it ends in an incomplete UTF-8 character ("\\ufffd").
    """

    CONTEXT = 6  # emitted tokens decoded again as context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._context = list(prompt_ids)[-self.CONTEXT :]  # emitted tokens
        self._pending: list[int] = []  # tokens whose text is not emitted yet
        self.text = ""  # all text emitted so far

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly "")."""
        self._pending.append(token_id)
        before = self._tok.decode(self._context)
        after = self._tok.decode(self._context + self._pending)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        new = after[len(before) :]
        self._context = (self._context + self._pending)[-self.CONTEXT :]
        self._pending = []
        self.text += new
        return new

    def flush(self) -> str:
        """Emit what is still held back (the completion has ended), incomplete characters included."""
        if not self._pending:
            return ""
        before = self._tok.decode(self._context)
        new = self._tok.decode(self._context + self._pending)[len(before) :]
        self._context, self._pending = (self._context + self._pending)[-self.CONTEXT :], []
        self.text += new
        return new
