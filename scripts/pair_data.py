"""The data of the shipped pair (scripts/train_pair.py): the corpus (the interpreter's standard
library, about 5% of its files held out by a hash of their path), the byte-level BPE tokenizer
trained on it, the corpus as token ids, and the held-out benchmark prompts.
"""
from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|eos|>"


# --- corpus ---------------------------------------------------------------------------------
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



# --- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size: int):
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



# --- held-out prompts -----------------------------------------------------------------------
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
