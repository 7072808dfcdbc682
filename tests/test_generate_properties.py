"""Property tests of the public Generate API over real gRPC: whatever the GenerateRequest holds
(empty or unicode prompts, out-of-range token ids, zero/negative/huge lengths, NaN/inf/negative
sampling values, empty stop strings, absurd K), the answer is either a complete stream that ends
with a finish_reason or INVALID_ARGUMENT with a message: never INTERNAL/UNKNOWN, never a hang, and
the server keeps serving normal requests afterwards with every KV block freed."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.frontend.server_thread import run_server_in_thread
from specdec import ServiceConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec_app.embedded import LocalSchedulerFactory

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy
from gates import wait_until
from served_pair import save_tokenizer

MAX_POS = 128
VOCAB = CONFIGS["gqa_untied"]["vocab_size"]
CALL_TIMEOUT_S = 30.0
# A deeper search on demand: SPECDEC_HYPOTHESIS_EXAMPLES=500 pytest tests/test_generate_properties.py
EXAMPLES = int(os.environ.get("SPECDEC_HYPOTHESIS_EXAMPLES", "60"))
INT32 = (-(2 ** 31), 2 ** 31 - 1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("prop-target"), seed=0, max_position_embeddings=MAX_POS,
                              **CONFIGS["gqa_untied"])
    save_tokenizer(target)
    draft = perturbed_copy(target, tmp_path_factory.mktemp("prop-draft"), noise=0.1)
    factory = LocalSchedulerFactory(ServiceConfig.from_settings(
        target=str(target), draft=str(draft), num_speculative_tokens=4, kv_cache_blocks=96, kv_block_size=8))
    with run_server_in_thread(factory, factory.tokenizer) as handle:
        channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
        yield SimpleNamespace(handle=handle, factory=factory, stub=generation_pb2_grpc.GenerationStub(channel))
        channel.close()


# --- strategies --------------------------------------------------------------------------------
# Each field has a valid and an "anything" strategy; every example picks at most two fields to draw
# from "anything", so about half of the examples are valid requests that must really complete.

extreme_floats = st.sampled_from([0.0, -0.0, -1.0, 1e-45, 5e-324, 1e-300, 1e300, 1.7976931348623157e308,
                                  math.inf, -math.inf, math.nan, 0.9999999999, 1.0000000001, 2.0])
any_float = st.one_of(extreme_floats, st.floats(allow_nan=True, allow_infinity=True))
any_int32 = st.one_of(st.sampled_from([0, 1, -1, *INT32, VOCAB - 1, VOCAB, 2 ** 16]), st.integers(*INT32))
any_uint64 = st.one_of(st.sampled_from([0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]), st.integers(0, 2 ** 64 - 1))
ascii_words = st.text(alphabet=st.sampled_from(list("the quick brown fox ")), min_size=1, max_size=40)

VALID = {
    "prompt": st.one_of(ascii_words.filter(str.strip),
                        st.sampled_from(["é", "🦊🦊", "日本語のテキスト", "the quick brown fox", "x\x00y"])),
    "prompt_token_ids": st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)),
    "max_new_tokens": st.one_of(st.none(), st.integers(1, 24)),
    "temperature": st.one_of(st.none(), st.just(0.0), st.floats(0.05, 3.0), st.sampled_from([1e-300, 1e300])),
    "top_p": st.one_of(st.none(), st.floats(1e-6, 1.0), st.sampled_from([1e-300, 1.0])),
    "repetition_penalty": st.one_of(st.none(), st.floats(0.2, 3.0), st.sampled_from([1e-300, 1e300])),
    "top_k": st.one_of(st.just(0), st.integers(1, 2 * VOCAB), st.just(INT32[1])),
    "seed": st.one_of(st.none(), any_uint64),
    "stop": st.lists(st.one_of(st.text(min_size=1, max_size=4), st.sampled_from(["e", " ", "🦊", "fox"])),
                     max_size=3),
    "num_speculative_tokens": st.one_of(st.none(), st.integers(0, 6)),
}
ANYTHING = {
    "prompt": st.one_of(st.just(""), st.text(max_size=200), st.sampled_from(["   ", "\u200b", "\x00"])),
    "prompt_token_ids": st.one_of(st.lists(any_int32, min_size=1, max_size=6),
                                  st.lists(st.integers(0, VOCAB - 1), min_size=MAX_POS - 2, max_size=MAX_POS + 2)),
    "max_new_tokens": st.one_of(st.integers(-3, 130), st.sampled_from([0, -1, 127, 128, *INT32])),
    "temperature": any_float,
    "top_p": any_float,
    "repetition_penalty": any_float,
    "top_k": any_int32,
    "seed": any_uint64,
    "stop": st.lists(st.one_of(st.just(""), st.text(max_size=5)), min_size=1, max_size=3),
    "num_speculative_tokens": st.one_of(st.integers(-2, 70), st.sampled_from([64, 65, 1000, *INT32])),
}


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    wild = draw(st.sets(st.sampled_from(sorted(VALID)), max_size=2))
    value = {name: draw(ANYTHING[name] if name in wild else VALID[name]) for name in sorted(VALID)}
    req = generation_pb2.GenerateRequest(prompt=value["prompt"], prompt_token_ids=value["prompt_token_ids"],
                                         stop=value["stop"], ignore_eos=draw(st.booleans()))
    for name in ("max_new_tokens", "num_speculative_tokens"):
        if value[name] is not None:
            setattr(req, name, value[name])
    req.sampling.top_k = value["top_k"]
    for name in ("temperature", "top_p", "repetition_penalty", "seed"):
        if value[name] is not None:
            setattr(req.sampling, name, value[name])
    return req


# --- the properties --------------------------------------------------------------------------


def call(stub, req: generation_pb2.GenerateRequest):
    """('ok', responses) or ('error', code, details); a hang fails as DEADLINE_EXCEEDED."""
    responses = []
    try:
        for response in stub.Generate(req, timeout=CALL_TIMEOUT_S):
            responses.append(response)
    except grpc.RpcError as e:
        return "error", e.code(), e.details() or ""
    return "ok", responses


def check_answer(served, req: generation_pb2.GenerateRequest) -> None:
    result = call(served.stub, req)
    if result[0] == "error":
        _, code, details = result
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code.name}: {details}\nrequest: {req}"
        assert details.strip(), f"INVALID_ARGUMENT without a message for {req}"
        event(f"rejected: {details.split(' must ')[0].split(' ')[0]}")
        return
    responses = result[1]
    assert responses, f"an empty stream for {req}"
    assert all(r.finish_reason == "" for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason in ("length", "eos", "stop"), f"finish_reason {last.finish_reason!r} for {req}"
    n = sum(len(r.token_ids) for r in responses)
    limit = req.max_new_tokens if req.HasField("max_new_tokens") else 64
    assert 1 <= limit and n <= limit
    assert last.stats.generated_tokens == n
    if last.finish_reason == "length":
        assert n == limit
    assert all(0 <= t < VOCAB for r in responses for t in r.token_ids)
    assert all(r.thread._thread.is_alive() for r in served.handle.server.scheduler.replicas)
    event(f"completed: {last.finish_reason}")


@pytest.mark.timeout(300)
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(req=generate_requests())
def test_any_request_gets_a_stream_or_invalid_argument(served, req):
    check_answer(served, req)


@pytest.mark.parametrize("fields", [
    dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e300),
    dict(temperature=1.0, repetition_penalty=1e-300), dict(temperature=1.0, repetition_penalty=1e300),
    dict(repetition_penalty=5e-324), dict(repetition_penalty=1.7976931348623157e308),
    dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_k=2 ** 31 - 1), dict(top_k=1),
    dict(temperature=1.0, seed=2 ** 64 - 1),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_extreme_but_valid_sampling_values_complete(served, fields):
    """Values the API accepts, at the edge of float range: they must decode, not crash a round."""
    req = generation_pb2.GenerateRequest(prompt="the quick brown fox", max_new_tokens=12, ignore_eos=True)
    for name, value in fields.items():
        setattr(req.sampling, name, value)
    result = call(served.stub, req)
    assert result[0] == "ok", f"{result[1].name}: {result[2]}"
    assert result[1][-1].finish_reason == "length" and sum(len(r.token_ids) for r in result[1]) == 12


@pytest.mark.parametrize("prompt_len,max_new,k", [(MAX_POS - 1, 1, 6), (MAX_POS - 5, 5, 6), (MAX_POS - 8, 8, 64),
                                                   (1, MAX_POS - 1, 6), (MAX_POS, 1, 0)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_context_edge(served, prompt_len, max_new, k, temperature):
    """At the end of the context K must shrink; one token past it is INVALID_ARGUMENT."""
    req = generation_pb2.GenerateRequest(prompt_token_ids=[(7 * i) % VOCAB for i in range(prompt_len)],
                                         max_new_tokens=max_new, num_speculative_tokens=k, ignore_eos=True)
    req.sampling.temperature, req.sampling.seed = temperature, 11
    result = call(served.stub, req)
    if prompt_len + max_new > MAX_POS:
        assert result[0] == "error" and result[1] == grpc.StatusCode.INVALID_ARGUMENT
        assert "context length" in result[2]
    else:
        assert result[0] == "ok", f"{result[1].name}: {result[2]}"
        assert result[1][-1].finish_reason == "length" and sum(len(r.token_ids) for r in result[1]) == max_new


def test_server_still_serves_and_frees_every_block(served):
    req = generation_pb2.GenerateRequest(prompt="hello server", max_new_tokens=8)
    result = call(served.stub, req)
    assert result[0] == "ok" and result[1][-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in result[1]) == 8
    factory = served.factory
    # Releases go out with the next round or an idle flush, soon after the last response.
    wait_until(lambda: not (factory.target_worker.cache.allocator.num_used
                            or factory.draft_worker.drafter.runner.cache.allocator.num_used))
    assert factory.target_worker.cache.allocator.num_used == 0
    assert factory.draft_worker.drafter.runner.cache.allocator.num_used == 0
