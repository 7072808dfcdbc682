"""A small served pair for the end-to-end tests: a random target with a trained tokenizer and a
perturbed copy of it as the draft, the in-process engine the served pair must equal, the pair
behind an in-process gRPC server on loopback, and what the tests check it with (health, KV blocks
in use, a throwaway TLS certificate)."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.frontend.server import SERVICE_NAME
from coordinator.frontend.server_thread import run_server_in_thread
from specdec import LocalEngine, ServiceConfig
from specdec.client import GenerationClient
from specdec.params import SamplingParams
from specdec_app.embedded import LocalSchedulerFactory

from checkpoints import CONFIGS, add_chat_template, build_checkpoint, perturbed_copy

K = 4
MAX_POS = 128
KV = dict(kv_cache_blocks=96, kv_block_size=8)
PROMPTS = ["the quick brown fox", "hello server", "speculative decoding drafts tokens", "lazy dog"]
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)


def save_tokenizer(path) -> None:
    """A tiny BPE trained here, vocab 120 (< the model's 300; larger model ids decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts tokens and the target "
              "verifies them", "hello world, hello server; stream the text back to the client"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def build_pair(tmp_path_factory, name: str, chat_template: bool = False) -> SimpleNamespace:
    """A random target with a trained tokenizer (and, if asked, a chat template) and a perturbed
    copy of it as the draft."""
    target = build_checkpoint(tmp_path_factory.mktemp(f"{name}-target"), seed=0, max_position_embeddings=MAX_POS,
                              **CONFIGS["gqa_untied"])
    save_tokenizer(target)
    if chat_template:
        add_chat_template(target)
    draft = perturbed_copy(target, tmp_path_factory.mktemp(f"{name}-draft"), noise=0.3)
    return SimpleNamespace(target=str(target), draft=str(draft))


def service_config(models, draft="model", **settings) -> ServiceConfig:
    return ServiceConfig.from_settings(target=models.target, draft=models.draft if draft == "model" else draft,
                                       num_speculative_tokens=K, adaptive=False, **KV, **settings)


def local_reference(models) -> LocalEngine:
    """What the served pair must answer: the same models in process, K fixed."""
    return LocalEngine(models.target, draft=models.draft, num_speculative_tokens=K, adaptive=False, **KV)


@contextmanager
def serving(models):
    """The pair behind an in-process gRPC server on loopback, and a client of it."""
    factory = LocalSchedulerFactory(service_config(models))
    with run_server_in_thread(factory, factory.tokenizer) as handle:
        with GenerationClient(f"127.0.0.1:{handle.port}") as client:
            yield SimpleNamespace(handle=handle, client=client, factory=factory, scheduler=handle.server.scheduler)


def expected(reference, prompt, n=24, k=None, **sampling):
    out = reference.generate([prompt], SamplingParams(max_new_tokens=n, **sampling), num_speculative_tokens=k)[0]
    return out


def loading_factory(factory) -> tuple[threading.Event, Callable]:
    """(loaded, a factory that builds with `factory` once `loaded` is set): a server whose engine
    is still loading until the test says so."""
    loaded = threading.Event()

    def build():
        loaded.wait(120)  # the test sets it; the bound only ends a broken test
        return factory()

    return loaded, build


def slow_rounds(scheduler_thread, seconds):
    """Rounds take `seconds` longer: for tests that want long rounds, not to catch a state (hold
    the state with gates.RoundGate instead)."""
    scheduler_thread.on_round = lambda report: time.sleep(seconds)


def kv_used(factory) -> int:
    return factory.target_worker.cache.allocator.num_used


def health_status(port: int) -> int:
    """The public server's gRPC health status (of the Generation service)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def self_signed_cert(tmp_path) -> tuple:
    """A throwaway certificate and key for 127.0.0.1 (skips the test without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key
