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
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from pair_data import BOS, EOS, encode_docs, load_corpus, train_tokenizer, wrap_tokenizer, write_prompts
from pair_training import (
    DRAFT_SHAPE,
    TARGET_SHAPE,
    eval_windows,
    evaluate,
    make_config,
    make_model,
    n_params,
    save_model,
    train_timed,
)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX), read from Linux's flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast in training (default: where the CPU computes bf16 natively; elsewhere "
                         "it is emulated, ~25x slower on an AVX2 CPU)")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=300)
    ap.add_argument("--max-steps", type=int, default=0, help="debug: cap steps per model")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--draft-only", action="store_true", help="keep <out>/target, retrain the draft")
    ap.add_argument("--resume-target", action="store_true",
                    help="continue training <out>/target for --minutes-target more minutes, then retrain the draft")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.bf16 is None:
        args.bf16 = cpu_has_native_bf16()

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
