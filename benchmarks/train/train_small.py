"""Train a small DeepSeek-V3-architecture model on the Python standard library; write an HF checkpoint.

    python benchmarks/train/train_small.py OUT_DIR [--config micro|small|deep] [--device cpu|cuda]
        [--minutes M] [--steps N] [--seed S] [--fp8]

The model is transformers' DeepseekV3ForCausalLM (MLA with q-LoRA, YaRN, a dense first layer,
then MoE layers with noaux_tc routing and one shared expert) plus one MTP layer (V3's
multi-token prediction, depth 1, written here: transformers has none). Loss = main CE +
MTP_LAMBDA * MTP CE, with PACE_STEPS = (5, 15)  # the steps between which the pace is timed (after the first, slower ones)
MTP_LAMBDA = 0.3, the V3 paper's weight for its first 10T tokens.
The routing bias (`e_score_correction_bias`) follows V3's auxiliary-loss-free balancing: after
each step it moves by BIAS_SPEED against each expert's load error.

`micro` runs on a 2-core CPU in seconds (the CPU test trains it); `small` is the one-GPU,
five-minute model; `deep` is as deep as V2-Lite (27 layers, d 256), so that its MTP draft costs a
real DeepSeek model's share of a decode step (speculative decoding's measurement). The clock
(--minutes) stops training; the pace of steps 5..15 plans how many steps fit, and the LR schedule
ends there (train_report's steps_planned: with `--steps` set to it, a run repeats exactly). AdamW, float32 on CPU, bf16 autocast on CUDA; fixed seed and data order.
OUT_DIR gets config.json, model.safetensors (the MTP layer at index num_hidden_layers, bf16, or
FP8 with --fp8), tokenizer.json, tokenizer_config.json (chat template), generation_config.json,
and train_report.json (parameters, steps, tokens, seconds, losses, held-out perplexity against
a unigram baseline, a greedy continuation of a Python prompt).
transformers is a benchmark dependency: it is imported here only, never by mlac.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlac.core.errors import MlacError
from mlac.synth import train_data
from mlac.synth.tokenizer import BOS, CHAT_TEMPLATE, EOS, train_bpe
from mlac.synth.train_export import write_checkpoint

PACE_STEPS = (5, 15)  # the steps between which the pace is timed (after the first, slower ones)
MTP_LAMBDA = 0.3  # V3 paper: 0.3 for the first 10T tokens, 0.1 for the rest
BIAS_SPEED = 1e-3  # V3 paper's bias update speed gamma for auxiliary-loss-free balancing
PROMPT = "def main():\n    "


@dataclass(frozen=True)
class Recipe:
    """Model shape (HF config fields) and training settings of one named config."""

    model: dict[str, Any]
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int
    train_bytes: int | None  # cap on the train split's text (None: all of it)
    held_bytes: int | None
    eval_windows: int
    log_every: int


def _v3(vocab: int, d: int, layers: int, heads: int, q_lora: int, kv_lora: int, rope: int, seq: int) -> dict:
    """A DeepSeek-V3 config.json dict: MLA with q-LoRA, YaRN over `seq` original positions,
    layer 0 dense, noaux_tc routing over 4 groups (2 kept), 1 shared expert, 1 MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": 3 * d,
        "moe_intermediate_size": d // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": 2 * rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": 2 * rope,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4 * seq,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": seq,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


RECIPES: dict[str, Recipe] = {
    "micro": Recipe(
        model=_v3(vocab=768, d=128, layers=2, heads=2, q_lora=64, kv_lora=64, rope=16, seq=64),
        seq=64,
        batch=8,
        steps=30,
        lr=3e-3,
        warmup=5,
        train_bytes=1_000_000,
        held_bytes=200_000,
        eval_windows=16,
        log_every=5,
    ),  # fmt: skip
    "small": Recipe(
        model=_v3(vocab=4096, d=512, layers=6, heads=8, q_lora=384, kv_lora=256, rope=32, seq=512),
        seq=512,
        batch=32,
        steps=3000,
        lr=1.5e-3,
        warmup=100,
        train_bytes=None,
        held_bytes=None,
        eval_windows=256,
        log_every=50,
    ),  # fmt: skip
    # As deep as V2-Lite (27 layers: 1 dense + 26 MoE; and the MTP layer), for speculative decoding:
    # the MTP draft is then 1/28 of the model, as in real DeepSeek models (in `small`, 1/7).
    # d 256, 4 heads, small's head and latent sizes (nope 64, rope 32, v 64, kv_lora 256), experts of
    # 128 wide. 60.2M parameters (main 58.0M). Weights a token passes through: 28.4M (main 25.2M,
    # MTP 1.06M, the two heads 2.10M); + causal attention over 512 positions, 4.6M MACs: 6 x 33.0M =
    # 198 MFLOP per trained token (small: 176M). Its training step is 3.9x small's in ops (8,364 vs
    # 2,148 aten ops, counted on CPU), each on tensors half as wide: small's step is bound by that
    # elementwise traffic (29 TFLOP/s at 170k tok/s), so ~85k tok/s on an H200, ~20M tokens (1,250
    # steps) in 4 minutes; FLOPs alone would allow ~150k tok/s. The `pace:` line says which.
    "deep": Recipe(
        model=_v3(vocab=4096, d=256, layers=27, heads=4, q_lora=256, kv_lora=256, rope=32, seq=512),
        seq=512,
        batch=32,
        steps=3000,
        lr=1e-3,
        warmup=100,
        train_bytes=None,
        held_bytes=None,
        eval_windows=256,
        log_every=50,
    ),  # fmt: skip
}


# ---- the MTP layer -------------------------------------------------------------------------


class MTPLayer(nn.Module):
    """V3 multi-token prediction, depth 1: from the main model's final (normed) hidden state h_i
    and the embedding of t_{i+1}, predict t_{i+2}.

        x = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])      # [B, T, D]  (embedding half first)
        x = block(x)                                          # one decoder layer (MoE)
        logits = lm_head(shared_head.norm(x))                 # the main model's embed and head

    The concatenation order and the input h (after the main model's final norm) are those of
    vLLM's and SGLang's DeepSeek MTP, which serve the released V3 weights.
    """

    def __init__(self, config: Any, layer_idx: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.enorm = DeepseekV3RMSNorm(d, eps)
        self.hnorm = DeepseekV3RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx)
        self.head_norm = DeepseekV3RMSNorm(d, eps)

    def forward(self, h: torch.Tensor, emb_next: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """h, emb_next [B, T, D] -> the normed hidden state [B, T, D] that lm_head reads."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        x = self.block(x, attention_mask=None, position_embeddings=rope)  # sdpa: causal when no mask
        return self.head_norm(x)

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """This layer's tensors under V3's names, at `model.layers.{layer_idx}.`."""
        pre = f"model.layers.{self.layer_idx}."
        out = {pre + k: v for k, v in self.block.state_dict().items()}
        out[pre + "enorm.weight"] = self.enorm.weight
        out[pre + "hnorm.weight"] = self.hnorm.weight
        out[pre + "eh_proj.weight"] = self.eh_proj.weight
        out[pre + "shared_head.norm.weight"] = self.head_norm.weight
        return out


class Trainee(nn.Module):
    """transformers' DeepseekV3ForCausalLM and one MTP layer; `losses` is the training objective."""

    def __init__(self, raw: dict[str, Any]):
        import transformers

        super().__init__()
        kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "torch_dtype")}
        config = transformers.DeepseekV3Config(**kwargs, attn_implementation="sdpa")
        self.lm = transformers.DeepseekV3ForCausalLM(config)
        self.mtp = MTPLayer(config, config.num_hidden_layers)
        self.mtp.apply(self.lm._init_weights)

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T + 2] token ids -> (main CE over x[:, 1:T+1], MTP CE over x[:, 2:T+2])."""
        inputs = x[:, :-2]  # [B, T]
        h = self.lm.model(input_ids=inputs).last_hidden_state  # [B, T, D], after the final norm
        main = self._ce(self.lm.lm_head(h), x[:, 1:-1])
        pos = torch.arange(inputs.shape[1], device=x.device)[None]  # [1, T]
        rope = self.lm.model.rotary_emb(h, position_ids=pos)
        g = self.mtp(h, self.lm.model.embed_tokens(x[:, 1:-1]), rope)
        return main, self._ce(self.lm.lm_head(g), x[:, 2:])

    @staticmethod
    def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under HF names (experts still stacked, as transformers holds them)."""
        return {**self.lm.state_dict(), **self.mtp.hf_tensors()}


# ---- auxiliary-loss-free balancing -----------------------------------------------------------


class Balancer:
    """Counts each router's expert loads in a step, then nudges e_score_correction_bias."""

    def __init__(self, model: nn.Module):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for r, load in zip(self.routers, self.loads, strict=True):
            r.register_forward_hook(lambda _m, _i, out, load=load: self._count(out[2], load))

    @staticmethod
    def _count(topk: torch.Tensor, load: torch.Tensor) -> None:
        """Add the step's expert choices topk [tokens, k] to load [E] (returns None: a hook
        that returned a value would replace the router's output)."""
        if torch.is_grad_enabled():  # training forwards only
            load.add_(torch.bincount(topk.flatten(), minlength=load.numel()).to(load.dtype))

    @torch.no_grad()
    def step(self) -> None:
        """bias += BIAS_SPEED * sign(mean load - load): underloaded experts become likelier."""
        for r, load in zip(self.routers, self.loads, strict=True):
            r.e_score_correction_bias.add_(BIAS_SPEED * torch.sign(load.mean() - load))
            load.zero_()


# ---- training and evaluation -----------------------------------------------------------------


def pick_experts_path(model: Trainee, device: str) -> str:
    """transformers' routed-experts kernel: its default (grouped_mm) where one bf16-autocast forward
    and backward runs with it on `device` (float32 master weights), else its per-expert loop
    ("eager"). Returns the one kept; leaves no gradients behind."""
    current = model.lm.config._experts_implementation
    if device != "cuda":
        return current
    x = torch.zeros(1, 18, dtype=torch.int64, device=device)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            main, mtp = model.losses(x)
        (main + mtp).backward()
    except (RuntimeError, NotImplementedError) as e:
        print(f"experts: {current} failed here ({str(e).splitlines()[0][:200]}); using the per-expert loop")
        current = "eager"
        for m in model.modules():  # the MTP block holds the same config object; set every holder
            if isinstance(getattr(m, "config", None), type(model.lm.config)):
                m.config._experts_implementation = current
    model.zero_grad(set_to_none=True)
    return current


def lr_at(step: int, r: Recipe, steps: int) -> float:
    """Linear warmup, then linear decay to 10% at `steps`."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    return r.lr * (1.0 - 0.9 * min(1.0, (step - r.warmup) / max(1, steps - r.warmup)))


def planned_steps(steps: int, seconds_per_step: float, elapsed: float, minutes: float) -> int:
    """The steps that fit in `minutes` at the measured pace (2% spare), at most `steps`."""
    return min(steps, PACE_STEPS[1] + int(0.98 * (minutes * 60 - elapsed) / seconds_per_step))


def train(model: Trainee, stream: torch.Tensor, r: Recipe, args: argparse.Namespace) -> dict[str, Any]:
    """Run AdamW for args.steps steps, or as many as fit in args.minutes: at step PACE_STEPS[1] the
    pace of the steps since PACE_STEPS[0] plans the horizon that the LR decays over (so a run cut by
    the clock still ends its schedule; rerun it with `--steps <planned>` to repeat it exactly).
    The clock stops training in any case. Returns the loss history and counts."""
    device = torch.device(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)
    balancer = Balancer(model)
    data = train_data.windows(stream, r.batch, r.seq, args.seed)
    losses: list[float] = []
    mtp_losses: list[float] = []
    start = last = paced = time.perf_counter()
    step, horizon = 0, args.steps
    while step < horizon and time.perf_counter() - start < args.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, r, horizon)
        x = next(data).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp = model.losses(x)
        opt.zero_grad(set_to_none=True)
        (main + MTP_LAMBDA * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.step()
        losses.append(main.item())
        mtp_losses.append(mtp.item())
        step += 1
        if step == PACE_STEPS[0]:
            paced = time.perf_counter()
        if step == PACE_STEPS[1] and horizon > step:
            now = time.perf_counter()
            pace = (now - paced) / (step - PACE_STEPS[0])  # seconds per step
            horizon = planned_steps(args.steps, pace, now - start, args.minutes)
            print(f"pace: {pace:.3f} s/step, {r.batch * r.seq / pace:,.0f} tok/s: {horizon} of {args.steps} steps "
                  f"fit --minutes {args.minutes}; the LR schedule ends at step {horizon}", flush=True)  # fmt: skip
        if step % r.log_every == 0 or step == horizon:
            now = time.perf_counter()
            tok_s = r.log_every * r.batch * r.seq / (now - last)
            print(
                f"step {step:5d}  loss {losses[-1]:.4f}  mtp {mtp_losses[-1]:.4f}  {tok_s:,.0f} tok/s",
                flush=True,
            )
            last = now
    seconds = time.perf_counter() - start
    return {"steps": step, "steps_planned": horizon, "tokens": step * r.batch * r.seq, "seconds": round(seconds, 2),
            "losses": losses, "mtp_losses": mtp_losses}  # fmt: skip


@torch.no_grad()
def held_out_loss(model: Trainee, windows: torch.Tensor, batch: int, device: str) -> tuple[float, float]:
    """Token-weighted mean (main, MTP) CE over windows [n, T + 2] (main: targets [:, 1:T+1])."""
    model.eval()
    main = mtp = 0.0
    for chunk in windows.split(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            a, b = model.losses(chunk.to(device))
        main += a.item() * chunk.shape[0]
        mtp += b.item() * chunk.shape[0]
    model.train()
    return main / windows.shape[0], mtp / windows.shape[0]


@torch.no_grad()
def greedy(model: Trainee, tok: Any, prompt: str, n: int, device: str) -> str:
    """Greedy continuation of `prompt` by the main model (no cache: n small forwards)."""
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    for _ in range(n):
        logits = model.lm(input_ids=ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    return tok.decode(ids[0].tolist(), skip_special_tokens=True)


# ---- output ----------------------------------------------------------------------------------


def write_tokenizer(out: Path, tok: Any, max_len: int) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json (chat template), generation_config.json; bos/eos ids."""
    tok.save(str(out / "tokenizer.json"), pretty=True)
    ids = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}
    tokenizer_config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
        "pad_token": EOS, "clean_up_tokenization_spaces": False, "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", {**ids, "do_sample": True, "temperature": 0.6, "top_p": 0.95})
    return ids


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlacError(f"{out}: exists and is not an empty directory; remove it or pick another")


# ---- main ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train args.config into args.out; returns the report (also written as train_report.json)."""
    r = RECIPES[args.config]
    out = Path(args.out)
    check_out_dir(out)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MlacError("--device cuda: no CUDA device is available")
    torch.manual_seed(args.seed)
    train_files, held_files = train_data.split(train_data.stdlib_files())
    train_texts = train_data.read_texts(train_files, r.train_bytes)
    tok = train_bpe(train_texts, r.model["vocab_size"])
    stream = train_data.encode(tok, train_texts)
    held = train_data.encode(tok, train_data.read_texts(held_files, r.held_bytes))
    held_windows = train_data.eval_windows(held, r.seq + 1, r.eval_windows)  # [n, T + 2]
    print(f"corpus: {len(train_texts)} train files, {stream.numel():,} tokens; {held.numel():,} held out")

    model = Trainee(r.model).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters (main {sum(p.numel() for p in model.lm.parameters()):,})")
    experts = pick_experts_path(model, args.device)
    hist = train(model, stream, r, args)
    main_loss, mtp_loss = held_out_loss(model, held_windows, r.batch, args.device)
    targets = held_windows[:, 1:-1].flatten()  # the tokens the main head was scored on
    report = {
        "config": args.config, "device": args.device, "seed": args.seed, "fp8": args.fp8,
        "python": platform.python_version(), "torch": torch.__version__,
        "experts_implementation": experts, "parameters": n_params, "parameters_main": sum(p.numel() for p in model.lm.parameters()),
        "steps": hist["steps"], "steps_planned": hist["steps_planned"], "tokens": hist["tokens"],
        "seconds": hist["seconds"], "tokens_per_s": round(hist["tokens"] / hist["seconds"]),
        "train_files": len(train_texts), "train_tokens": stream.numel(),
        "held_out_tokens": targets.numel(), "mtp_lambda": MTP_LAMBDA,
        "final_train_loss": hist["losses"][-1], "final_train_mtp_loss": hist["mtp_losses"][-1],
        "held_out_loss": main_loss, "held_out_perplexity": math.exp(main_loss),
        "held_out_mtp_loss": mtp_loss,
        "unigram_perplexity": train_data.unigram_perplexity(stream, targets, r.model["vocab_size"]),
        "greedy_prompt": PROMPT, "greedy_continuation": greedy(model, tok, PROMPT, 32, args.device),
        "recipe": {k: v for k, v in asdict(r).items() if k != "model"},
        "losses": [round(x, 5) for x in hist["losses"]],
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    raw = {**r.model, **write_tokenizer(out, tok, r.model["max_position_embeddings"])}
    write_checkpoint(out, raw, model.hf_tensors(), args.fp8)
    _write_json(out / "train_report.json", report)
    print(
        f"held-out perplexity {report['held_out_perplexity']:.2f} (unigram {report['unigram_perplexity']:.2f})"
    )
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="output checkpoint directory (new or empty)")
    p.add_argument("--config", choices=sorted(RECIPES), default="micro")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--minutes", type=float, default=5.0, help="training time budget (default 5)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="store linear weights as FP8 blocks, as DeepSeek does")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = RECIPES[args.config].steps
    if args.steps < 1 or args.minutes <= 0:
        p.error("--steps and --minutes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except MlacError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
