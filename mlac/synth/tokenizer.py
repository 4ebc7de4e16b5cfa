"""A small real byte-level BPE tokenizer with DeepSeek's special tokens and chat template.

Trained with the `tokenizers` library on a built-in English text, so the files are the same on
every machine and every run. Any text round-trips (byte-level: no unknown tokens); English words
get multi-byte tokens, so token counts look like a real tokenizer's, at a fraction of the size.

After the trained ids come the tokens DeepSeek-V3's, R1's and V3.1's tokenizers add for tool calls
and thinking (ADDED_TOKENS), as their tokenizer.json has them: added tokens that are not
`special`, so that they stay in decoded text (where the tool-call and reasoning parsers read them)
and a grammar can name them (a forced tool call: runtime/serve/tool_choice.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mlac.core.errors import MlacError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)  # ids 0..3, as DeepSeek-V3 has bos 0 and eos 1
THINK, END_THINK = "<think>", "</think>"
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOL_OUTPUTS = (
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
# the last ids of the vocabulary, in this order (the real tokenizers' ids are above 128,000)
ADDED_TOKENS = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP, *TOOL_OUTPUTS,
                THINK, END_THINK)  # fmt: skip
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials and every byte
MIN_VOCAB = MIN_BPE_VOCAB + len(ADDED_TOKENS)  # a synthetic checkpoint's: the BPE and the added tokens
MAX_VOCAB = 1024  # every id, the specials, the 256 bytes and the added tokens included (CORPUS allows ~1150)

# DeepSeek-V3's template, less tools and thinking: bos, the system prompt, then the turns.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + message['content'] + '" + EOS + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT + "' -}}{%- endif -%}"
)

CORPUS = """\
The morning train left the station a few minutes after seven. Most of the passengers were
reading, some were asleep, and a small child by the window counted the bridges as they passed.
There were eleven of them before the river turned away from the line and the fields began.

A compiler reads a program and writes another one. The first is meant for people, the second
for a machine. Between the two sit many small passes, each of which changes one thing and keeps
the meaning of the whole. A good pass is short enough to hold in mind, and it says what it needs
and what it promises. When a test fails, the pass that broke the promise should be easy to find.

She opened the notebook and wrote the date at the top of the page. The experiment had run all
night. The numbers were close to what the model predicted, but not close enough: the error grew
with the length of the input, slowly at first and then faster. "Either the scale is wrong," she
said, "or the cache is being read before it is written." Her colleague looked at the graph for a
long time and then asked for the logs of the second run.

To bake bread you need flour, water, salt and time. Mix the flour and the water and let them
rest for half an hour. Add the salt and a little yeast, fold the dough every thirty minutes for
two hours, then shape it and leave it in a cool place overnight. In the morning, heat the oven
as hot as it will go, bake the loaf for forty minutes, and let it cool before you cut it.

The weather report for the coast: cloudy in the morning with a chance of light rain, clearing
in the afternoon. Winds from the west at fifteen to twenty kilometres per hour. Temperatures
between twelve and eighteen degrees. Tomorrow will be warmer and mostly sunny, with high clouds
moving in from the south by the evening.

Questions and answers. What is the capital of France? Paris. How many days are there in a leap
year? There are 366 days. Which planet is closest to the sun? Mercury. What is two plus three?
Five. Why is the sky blue? Because air scatters short wavelengths of light more than long ones,
so blue light reaches our eyes from every part of the sky.

The library was quiet except for the sound of pages turning. On the long table in the middle of
the room there were maps of old cities, a box of letters tied with string, and a book about the
history of clocks. Every clock in the book had a story: who built it, who paid for it, where it
stood, and how often it had to be wound. The oldest one still kept time, more or less.

Memory is the limit in most of these systems. A model with many experts needs room for all of
their weights, but each token only visits a few of them. The router decides which ones, and the
choice must be quick and stable. If two experts score the same, the tie must be broken the same
way every time, or the results will not repeat. Tests catch these things; guesses do not.

He walked along the harbour as the boats came in. The fishermen were tired and cheerful, and
they shouted the prices of the day to anyone who would listen. Gulls followed the boats and the
smell of salt and diesel hung over the water. At the end of the pier an old man was painting the
same lighthouse he had painted every summer for thirty years.

Numbers and lists: one, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May, June, July,
August, September, October, November, December. 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71 42.

def greet(name):
    return "Hello, " + name + "!"

for i in range(10):
    print(i, i * i)

Thank you for your question. Here is a short answer, followed by a longer explanation. In short:
yes, it works, but only when the input is sorted. The longer explanation is that the search
splits the list in half at every step, and that only tells you where to look next if the items
on the left are all smaller than the ones on the right.
"""


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids (DeepSeek's specials first, then the 256 bytes)
    trained on `texts`, adding bos to every encoding."""
    if vocab_size < MIN_BPE_VOCAB:
        raise MlacError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer (needs >= {MIN_BPE_VOCAB})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """The synthetic checkpoints' tokenizer: train_bpe on CORPUS, then ADDED_TOKENS; at most
    MAX_VOCAB ids in all (`vocab_size` >= MIN_VOCAB)."""
    if vocab_size < MIN_VOCAB:
        raise MlacError(
            f"vocab_size={vocab_size} is too small for the synthetic tokenizer (needs >= {MIN_VOCAB})"
        )
    tok = train_bpe(CORPUS.splitlines(keepends=True), min(vocab_size, MAX_VOCAB) - len(ADDED_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json; return the bos/eos ids."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    ids = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {**ids, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)
    return ids


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
