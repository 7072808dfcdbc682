"""The embedded server the hostile-client tests attack (gRPC and HTTP on 127.0.0.1): a small random
checkpoint with a context of MAX_POS tokens, the n-gram drafter, a waiting queue of MAX_WAITING and
the default request size limit; and what the tests measure it with (a normal request's latency,
how a refused call fails, this process's memory).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from specdec import ServiceConfig
from specdec.client import GenerationClient
from specdec.v1 import generation_pb2
from specdec_app.embedded import LocalSchedulerFactory

from checkpoints import CONFIGS, add_chat_template, build_checkpoint
from served_pair import KV, MAX_POS, save_tokenizer

LIMIT = 4 << 20  # ServerConfig.max_request_bytes by default
MAX_WAITING = 4
MAX_BATCH = 2
NORMAL = dict(max_new_tokens=32)
WORDS = "the quick brown fox jumps over the lazy dog "


def text_of(size: int) -> str:
    """`size` characters (and bytes) of ordinary words."""
    return (WORDS * (size // len(WORDS) + 1))[:size]


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (VmHWM: its peak); the server runs in it (on its own threads)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@contextmanager
def hostile_target_served(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The server, a client of it, a raw gRPC call and an HTTP client; stopped when the block ends."""
    target = build_checkpoint(tmp_path_factory.mktemp("hostile-target"), seed=0, max_position_embeddings=MAX_POS,
                              **CONFIGS["gqa_untied"])
    save_tokenizer(target)
    add_chat_template(target)
    factory = LocalSchedulerFactory(ServiceConfig.from_settings(target=str(target), draft="ngram",
                                                                max_batch_size=MAX_BATCH, **KV))
    config = replace(LOOPBACK_SERVER, max_waiting_requests=MAX_WAITING, max_request_bytes=LIMIT)
    with run_server_in_thread(factory, factory.tokenizer, config) as handle:
        address = f"127.0.0.1:{handle.port}"
        with GenerationClient(address) as client, grpc.insecure_channel(address) as channel:
            # Raw bytes on the wire, for requests no well-behaved client would serialize.
            raw = channel.unary_stream("/specdec.v1.Generation/Generate", request_serializer=lambda b: b,
                                       response_deserializer=generation_pb2.GenerateResponse.FromString)
            http = httpx.Client(base_url=f"http://127.0.0.1:{handle.http_port}", timeout=30)
            model = http.get("/v1/models").json()["data"][0]["id"]
            yield SimpleNamespace(handle=handle, client=client, raw=raw, http=http, model=model,
                                  scheduler=handle.server.scheduler, gate=handle.server.gate)
            http.close()


def refused(call) -> tuple[grpc.RpcError, float]:
    """Run a gRPC call that must fail; (its error, seconds it took)."""
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value, time.perf_counter() - start


def normal_latency(served) -> float:
    start = time.perf_counter()
    result = served.client.generate("the quick brown fox", timeout=20, **NORMAL)
    assert result.finish_reason == "length" and len(result.token_ids) == NORMAL["max_new_tokens"]
    return time.perf_counter() - start
