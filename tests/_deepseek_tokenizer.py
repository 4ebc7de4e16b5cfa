"""A tokenizer with DeepSeek-V3's chat and tool tokens, for tests: the synthetic byte-level BPE
(mlac/synth/tokenizer.py, whose added tokens are those DeepSeek's templates and tool calls write,
not special, as DeepSeek's tokenizer.json has them) with one of DeepSeek's published chat
templates. The real tokenizer cannot be downloaded here."""

from __future__ import annotations

import json
from pathlib import Path

from mlac.synth.tokenizer import write_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def deepseek_tokenizer_dir(root: Path, template: str, vocab_size: int = 2048) -> Path:
    """`root` with tokenizer.json (the synthetic tokenizer of at most `vocab_size` ids) and
    tokenizer_config.json (`template`)."""
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root, vocab_size=vocab_size, model_max_length=4096)
    cfg_file = root / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_file.write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return root


def template(name: str) -> str:
    """One of the published templates under tests/data/chat_templates (README.md there says whose)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
