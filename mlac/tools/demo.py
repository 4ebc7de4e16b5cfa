"""`mlac demo`: the whole path on CPU in about a minute.

Synthesize the tiny-v3 checkpoint, compile it (`--tp`, FP8 weights), serve the artifact in this
process on a free port of 127.0.0.1, send one chat request over HTTP (stdlib urllib: what any
client would do), then one that forces a tool call (`tool_choice` naming WEATHER_TOOL: the
answer is sampled under the tool-call grammar, so even random weights make a valid call), print
the replies and the timings, and shut the server down.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# the demo's tool: a bounded city name, so that a random model's call stays short
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"], "additionalProperties": False}}}  # fmt: skip


@dataclass(frozen=True)
class DemoResult:
    reply: str
    finish_reason: str
    usage: dict
    compile_s: float
    load_to_ready_s: float
    request_s: float
    tool_call: dict  # the forced call's {"name", "arguments"}


def run_demo(
    work: str | Path | None = None,
    tp: int = 2,
    prompt: str = "What is the capital of France?",
    max_tokens: int = 24,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Run the demo in `work` (a temporary directory, removed after, when None)."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix="mlac-demo-") as tmp:
            return _run(Path(tmp), tp, prompt, max_tokens, echo)
    return _run(Path(work), tp, prompt, max_tokens, echo)


def _run(work: Path, tp: int, prompt: str, max_tokens: int, echo: Callable[[str], None]) -> DemoResult:
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.runtime.serve import ServerConfig, ServerThread
    from mlac.synth import synthesize

    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / "tiny-v3", work / f"tiny-v3-tp{tp}-fp8"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    echo(f"synthesizing tiny-v3 in {ckpt}")
    synthesize(ckpt, preset="tiny-v3", seed=0)

    echo(f"compiling --tp {tp} --fp8 -> {out}")
    t0 = time.perf_counter()
    compile_checkpoint(ckpt, out, CompileOptions(tp=tp, fp8=True), force=True)
    compile_s = time.perf_counter() - t0

    echo("serving on CPU")
    t0 = time.perf_counter()
    config = ServerConfig.of(artifact=out, host="127.0.0.1", device="cpu", dtype="float32", drain_timeout=5.0)
    with ServerThread(config) as server:
        load_s = time.perf_counter() - t0
        body = {"model": config.model_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
        t0 = time.perf_counter()
        reply = _post(f"{server.url}/v1/chat/completions", body)
        request_s = time.perf_counter() - t0
        forced = {**body, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                  "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                  "max_tokens": 64}  # fmt: skip
        called = _post(f"{server.url}/v1/chat/completions", forced)["choices"][0]["message"]

    choice = reply["choices"][0]
    result = DemoResult(choice["message"]["content"], choice["finish_reason"], reply["usage"],
                        compile_s, load_s, request_s, called["tool_calls"][0]["function"])  # fmt: skip
    echo(f"user: {prompt}")
    echo(f"assistant: {result.reply!r}  (random weights: the words mean nothing)")
    u = result.usage
    echo(f"usage: {u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens, "
         f"finish: {result.finish_reason}")  # fmt: skip
    call = result.tool_call
    echo(f"forced tool call (tool_choice {call['name']}): {call['name']}({call['arguments']})")
    echo(f"timings: compile {compile_s:.2f} s, load to ready {load_s:.2f} s, request {request_s:.3f} s")
    return result


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())
