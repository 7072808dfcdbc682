#!/usr/bin/env python
"""Train the shipped toy TARGET/DRAFT model pair for specdec.

Corpus: the ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded), sorted by
relative path.  About 5% of the files (chosen by an md5 hash of the relative
path, so the split is deterministic) are held out: they are used neither for
the tokenizer nor for training, only for evaluation and for the benchmark
prompts written to ``<out>/heldout_prompts.jsonl``.

Steps:
  1. byte-level BPE tokenizer (vocab ~4096, ``<|bos|>``/``<|eos|>``), saved in
     both model dirs as a ``PreTrainedTokenizerFast``;
  2. TARGET: Llama (GQA), trained for ``--minutes-target`` wall-clock minutes;
  3. DRAFT: 1-layer Llama distilled from the target (CE + KL to the target's
     logits) for ``--minutes-draft`` minutes;
  4. report: parameter counts, held-out loss/perplexity, teacher-forced greedy
     agreement draft-vs-target on held-out text.

Example::

    python scripts/train_pair.py --out models --minutes-target 30 --minutes-draft 12 --seed 0

``--draft-only`` keeps an existing ``<out>/target`` and retrains the draft.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

BOS = "<|bos|>"
EOS = "<|eos|>"

# Model shapes.  Chosen from measurements on a 2-core CPU: the target costs
# ~8 ms per batch-1 decode step, the 1-layer draft ~0.7-0.9 ms (c ~ 0.1).
TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=1024)
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=704)


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------
def is_heldout(rel: str, mod: int = 20) -> bool:
    h = int(hashlib.md5(rel.encode("utf-8")).hexdigest()[:8], 16)
    return h % mod == 0


def load_corpus(max_file_bytes: int = 400_000):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "dist-packages" in rel.split("/"):
            continue
        files.append((rel, p))
    files.sort(key=lambda x: x[0])
    train, held = [], []
    for rel, p in files:
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if not raw or len(raw) > max_file_bytes:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace("\r\n", "\n")
        (held if is_heldout(rel) else train).append((rel, text))
    return root, train, held


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def encode_docs(tok, docs, bos_id, eos_id):
    encs = tok.encode_batch([t for _, t in docs])
    out = []
    for e in encs:
        out.append(bos_id)
        out.extend(e.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.int64)


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------
def make_config(shape, vocab_size, bos_id, eos_id, max_pos):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        **shape,
    )
    return cfg


def make_model(cfg):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(cfg)


def n_params(model) -> int:
    # tied embeddings are counted once
    return sum(p.numel() for p in model.parameters())


def save_model(model, tok_fast, path: Path, save_dtype: str):
    from transformers import GenerationConfig

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


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# held-out prompts
# --------------------------------------------------------------------------
def write_prompts(path: Path, held, tok, n_prompts: int, seed: int, lo=64, hi=200):
    rng = random.Random(seed + 1234)
    docs = [(r, t) for r, t in held if len(t) > 400]
    out = []
    attempts = 0
    while len(out) < n_prompts and attempts < n_prompts * 50:
        attempts += 1
        rel, text = docs[rng.randrange(len(docs))]
        lines = text.split("\n")
        if len(lines) < 8:
            continue
        start = rng.randrange(0, max(1, len(lines) - 5))
        target_len = rng.randint(lo + 16, hi - 8)
        buf, ntok = [], 0
        for ln in lines[start:]:
            buf.append(ln + "\n")
            ntok = len(tok.encode("".join(buf)).ids)
            if ntok >= target_len:
                break
        prompt = "".join(buf)
        while ntok > hi and len(buf) > 1:
            buf.pop()
            prompt = "".join(buf)
            ntok = len(tok.encode(prompt).ids)
        if not (lo <= ntok <= hi) or not prompt.strip():
            continue
        out.append({"prompt": prompt, "source": rel, "n_tokens": ntok})
    with open(path, "w", encoding="utf-8") as f:
        for o in out:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
    return len(out)


# --------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--minutes-target", type=float, default=30.0)
    ap.add_argument("--minutes-draft", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr-target", type=float, default=1.5e-3)
    ap.add_argument("--lr-draft", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--draft-ce-weight", type=float, default=0.3)
    ap.add_argument("--draft-kl-weight", type=float, default=0.7)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="disable bf16 autocast in training")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=300)
    ap.add_argument("--max-steps", type=int, default=0, help="debug: cap steps per model")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--draft-only", action="store_true", help="keep <out>/target, retrain the draft")
    ap.add_argument("--resume-target", action="store_true",
                    help="continue training <out>/target for --minutes-target more minutes, then retrain the draft")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    root, train_docs, held_docs = load_corpus()
    n_train_chars = sum(len(t) for _, t in train_docs)
    n_held_chars = sum(len(t) for _, t in held_docs)
    print(f"corpus: {root} (Python {sys.version.split()[0]}): {len(train_docs)} train files "
          f"({n_train_chars / 1e6:.1f}M chars), {len(held_docs)} held-out files "
          f"({n_held_chars / 1e6:.2f}M chars)", flush=True)

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    if args.draft_only or args.resume_target:
        tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    else:
        t0 = time.time()
        tok = train_tokenizer([t for _, t in train_docs], args.vocab_size)
        print(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.0f}s", flush=True)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok_fast = wrap_tokenizer(tok)
    sample = held_docs[0][1][:2000]
    assert tok.decode(tok.encode(sample).ids) == sample, "tokenizer does not round-trip"

    t0 = time.time()
    train_data = encode_docs(tok, train_docs, bos_id, eos_id)
    held_data = encode_docs(tok, held_docs, bos_id, eos_id)
    print(f"tokens: train {len(train_data) / 1e6:.2f}M, held-out {len(held_data) / 1e6:.3f}M "
          f"({n_train_chars / len(train_data):.2f} chars/token) in {time.time() - t0:.0f}s", flush=True)
    windows = eval_windows(held_data, args.eval_windows, args.seq_len)

    # fixed seed: the prompt set does not depend on --seed (stable across retrains)
    n_prompts = write_prompts(out / "heldout_prompts.jsonl", held_docs, tok, args.n_prompts, 0)
    with open(out / "heldout_files.txt", "w") as f:
        f.write("".join(r + "\n" for r, _ in held_docs))
    print(f"wrote {n_prompts} held-out prompts", flush=True)

    vocab = tok.get_vocab_size()
    report = {}
    # ---------------- target ----------------
    old = json.loads((out / "train_report.json").read_text()) if (out / "train_report.json").exists() else {}
    if args.draft_only:
        target = LlamaForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
        target.eval()
        report["target_train"] = old.get("target_train")
        report["commands"] = old.get("commands", [old.get("command")])
    elif args.resume_target:
        torch.manual_seed(args.seed)
        target = LlamaForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
        print(f"target (resumed): {n_params(target):,} params", flush=True)
        more = train_timed("target", target, train_data, args, args.minutes_target, args.lr_target, rng=rng)
        prev = old.get("target_train") or {}
        report["target_train"] = {k: round(prev.get(k, 0) + more[k], 1) for k in more}
        report["commands"] = old.get("commands", [old.get("command")])
        save_model(target, tok_fast, out / "target", args.save_dtype)
        target = LlamaForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
        target.eval()
    else:
        torch.manual_seed(args.seed)
        target = make_model(make_config(TARGET_SHAPE, vocab, bos_id, eos_id, args.max_pos))
        print(f"target: {n_params(target):,} params {TARGET_SHAPE}", flush=True)
        report["target_train"] = train_timed("target", target, train_data, args, args.minutes_target,
                                             args.lr_target, rng=rng)
        save_model(target, tok_fast, out / "target", args.save_dtype)
        target = LlamaForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
        target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    t_loss, t_pred = evaluate(target, windows)
    print(f"target held-out loss {t_loss:.4f} ppl {math.exp(t_loss):.2f}", flush=True)

    # ---------------- draft ----------------
    torch.manual_seed(args.seed + 1)
    draft = make_model(make_config(DRAFT_SHAPE, vocab, bos_id, eos_id, args.max_pos))
    print(f"draft: {n_params(draft):,} params {DRAFT_SHAPE}", flush=True)
    report["draft_train"] = train_timed("draft", draft, train_data, args, args.minutes_draft, args.lr_draft,
                                        teacher=target, ce_w=args.draft_ce_weight,
                                        kl_w=args.draft_kl_weight, rng=rng)
    save_model(draft, tok_fast, out / "draft", args.save_dtype)
    draft = LlamaForCausalLM.from_pretrained(str(out / "draft"), dtype=torch.float32)
    d_loss, d_pred = evaluate(draft, windows)
    agree = (d_pred == t_pred).float().mean().item()
    gold = windows[:, 1:]
    t_acc = (t_pred == gold).float().mean().item()
    d_acc = (d_pred == gold).float().mean().item()

    pt, pd = n_params(target), n_params(draft)
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    report.update(
        python=sys.version.split()[0], stdlib=str(root), command="python " + " ".join(sys.argv),
        commands=[c for c in report.get("commands", []) if c] + ["python " + " ".join(sys.argv)],
        train_files=len(train_docs), heldout_files=len(held_docs),
        train_tokens=int(len(train_data)), heldout_tokens=int(len(held_data)), vocab_size=vocab,
        target_shape=TARGET_SHAPE, draft_shape=DRAFT_SHAPE, target_params=pt, draft_params=pd,
        param_ratio=round(pt / pd, 2),
        eval_tokens=int(gold.numel()),
        target_heldout_loss=round(t_loss, 4), target_heldout_ppl=round(math.exp(t_loss), 3),
        draft_heldout_loss=round(d_loss, 4), draft_heldout_ppl=round(math.exp(d_loss), 3),
        target_top1_acc=round(t_acc, 4), draft_top1_acc=round(d_acc, 4),
        greedy_agreement=round(agree, 4), save_dtype=args.save_dtype,
        total_minutes=round((time.time() - t_start) / 60, 1),
    )
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    print("=" * 60)
    print(f"target params: {pt:,}   draft params: {pd:,}   ratio {pt / pd:.2f}x")
    print(f"held-out loss: target {t_loss:.4f} (ppl {math.exp(t_loss):.2f})   "
          f"draft {d_loss:.4f} (ppl {math.exp(d_loss):.2f})")
    print(f"held-out top-1 acc: target {t_acc:.4f}   draft {d_acc:.4f}")
    print(f"teacher-forced greedy agreement draft vs target: {agree:.4f} over {gold.numel()} tokens")
    print(f"{out} total size: {size_mb:.1f} MB; total time {(time.time() - t_start) / 60:.1f} min")
    return report


if __name__ == "__main__":
    main()
