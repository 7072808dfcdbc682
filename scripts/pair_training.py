"""The models of the shipped pair (scripts/train_pair.py): their Llama shapes, how one is built
and saved (Hugging Face layout with the tokenizer), trained for a wall-clock budget (the draft
distilled from the target: cross-entropy plus KL to the target's logits) and evaluated
teacher-forced on held-out windows.
"""
from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from pair_data import BOS, EOS

# Model shapes.  Chosen from measurements on a 2-core CPU: the target costs
# ~8 ms per batch-1 decode step, the 1-layer draft ~0.7-0.9 ms (c ~ 0.1).
TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=1024)
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=704)



# --- models ---------------------------------------------------------------------------------
# What both models of the pair share beyond their shape.
SHARED_CONFIG = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, attention_bias=False,
                     mlp_bias=False, hidden_act="silu", initializer_range=0.02)


def make_config(shape, vocab_size, bos_id, eos_id, max_pos):
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_pos, bos_token_id=bos_id,
                       eos_token_id=eos_id, pad_token_id=eos_id, **SHARED_CONFIG, **shape)


def make_model(cfg):
    return LlamaForCausalLM(cfg)


def n_params(model) -> int:
    # tied embeddings are counted once
    return sum(p.numel() for p in model.parameters())


def save_model(model, tok_fast, path: Path, save_dtype: str):
    path.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file():
            f.unlink()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[save_dtype]
    model = model.to(dtype)
    cfg = model.config
    try:
        cfg.dtype = save_dtype
    except Exception:  # older transformers
        cfg.torch_dtype = save_dtype
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, do_sample=False,
    )
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(path), **kwargs)
    tok_fast.save_pretrained(str(path))
    # transformers 5 no longer writes this file; older versions read it.
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    model.to(torch.float32)
    assert (path / "model.safetensors").exists(), "expected model.safetensors"



# --- training -------------------------------------------------------------------------------
def lr_at(frac: float, peak: float, warm_frac: float, floor: float = 0.1) -> float:
    if frac < warm_frac:
        return peak * max(frac / warm_frac, 0.02)
    p = min(1.0, (frac - warm_frac) / max(1e-9, 1.0 - warm_frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def sample_batch(data: np.ndarray, rng: np.random.Generator, bsz: int, seq: int):
    starts = rng.integers(0, len(data) - seq - 1, size=bsz)
    x = np.stack([data[s:s + seq + 1] for s in starts])
    return torch.from_numpy(x)


def make_optimizer(model, lr, wd):
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


def train_timed(name, model, data, args, minutes, peak_lr, teacher=None, ce_w=1.0, kl_w=0.0, rng=None):
    budget = minutes * 60.0
    opt = make_optimizer(model, peak_lr, args.weight_decay)
    model.train()
    if teacher is not None:
        teacher.eval()
    t0 = time.time()
    step, tokens = 0, 0
    ema = None
    bar = tqdm(total=int(budget), desc=f"train {name}", unit="s", dynamic_ncols=True, mininterval=5)
    last_shown = 0
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(frac, peak_lr, args.warmup_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        xb = sample_batch(data, rng, args.batch_size, args.seq_len)
        inp, tgt = xb[:, :-1], xb[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=inp).logits
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inp).logits
        logits = logits.float().reshape(-1, logits.size(-1))
        ce = F.cross_entropy(logits, tgt.reshape(-1))
        loss = ce_w * ce
        kl = torch.zeros(())
        if teacher is not None:
            t_lp = F.log_softmax(t_logits.float().reshape(-1, logits.size(-1)), dim=-1)
            s_lp = F.log_softmax(logits, dim=-1)
            kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1).mean()
            loss = loss + kl_w * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens += inp.numel()
        v = ce.item()
        ema = v if ema is None else 0.98 * ema + 0.02 * v
        now = int(time.time() - t0)
        if now > last_shown:
            bar.update(min(now, int(budget)) - last_shown)
            last_shown = min(now, int(budget))
        post = dict(step=step, ce=f"{ema:.3f}", lr=f"{lr:.2e}",
                    tok_s=f"{tokens / max(1e-9, time.time() - t0):.0f}")
        if teacher is not None:
            post["kl"] = f"{float(kl):.3f}"
        bar.set_postfix(post, refresh=False)
        if step % args.log_every == 0:
            print(f"[{name}] step {step} elapsed {time.time() - t0:.0f}s ce_ema {ema:.4f} "
                  f"kl {float(kl):.4f} lr {lr:.2e} tokens {tokens}", flush=True)
    bar.close()
    dt = time.time() - t0
    print(f"[{name}] done: {step} steps, {tokens} tokens, {dt / 60:.1f} min, "
          f"{tokens / max(dt, 1e-9):.0f} tok/s", flush=True)
    model.eval()
    return dict(steps=step, tokens=tokens, seconds=round(dt, 1))



# --- evaluation -----------------------------------------------------------------------------
def eval_windows(data: np.ndarray, n: int, seq: int):
    n = min(n, max(1, (len(data) - 1) // (seq + 1)))
    stride = (len(data) - seq - 1) // n
    return torch.from_numpy(np.stack([data[i * stride:i * stride + seq + 1] for i in range(n)]))


@torch.no_grad()
def evaluate(model, windows, bsz=8):
    """fp32 teacher-forced evaluation; returns (mean CE, argmax predictions)."""
    model.eval()
    tot, cnt, preds = 0.0, 0, []
    for i in range(0, len(windows), bsz):
        xb = windows[i:i + bsz]
        logits = model(input_ids=xb[:, :-1]).logits.float()
        tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1),
                               reduction="sum").item()
        cnt += xb[:, 1:].numel()
        preds.append(logits.argmax(-1))
    return tot / cnt, torch.cat(preds)
