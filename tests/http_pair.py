"""The HTTP API tests' pair and settings: a random target whose tokenizer has a chat template, a
`plain` copy of it without one, a perturbed copy as the draft, and the service config they run
with (the default adaptive speculation policy)."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from specdec import ServiceConfig

from checkpoints import CONFIGS, add_chat_template, build_checkpoint, perturbed_copy
from served_pair import KV, MAX_POS, save_tokenizer

K = 4
TOKEN = "s3cret"
PROMPT = "the quick brown fox"
IDS = [5, 17, 99, 3, 42]
CHAT = [{"role": "system", "content": "speculative decoding drafts tokens"},
        {"role": "user", "content": "hello server"}]


def http_pair(tmp_path_factory) -> SimpleNamespace:
    """The target (with a chat template), its `plain` copy (without) and the draft, as paths."""
    target = build_checkpoint(tmp_path_factory.mktemp("http-target"), seed=0, max_position_embeddings=MAX_POS,
                              **CONFIGS["gqa_untied"])
    save_tokenizer(target)
    plain = Path(shutil.copytree(target, tmp_path_factory.mktemp("http-plain") / "plain"))  # no chat template
    add_chat_template(target)
    draft = perturbed_copy(target, tmp_path_factory.mktemp("http-draft"), noise=0.3)
    return SimpleNamespace(target=str(target), draft=str(draft), plain=str(plain))


def http_config(models, **settings) -> ServiceConfig:
    """The pair's service config, `settings` on top."""
    return ServiceConfig.from_settings(**{"target": models.target, "draft": models.draft, "num_speculative_tokens": K,
                                          **KV, **settings})
