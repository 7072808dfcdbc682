"""The public gRPC service end to end over real gRPC on 127.0.0.1 (no Ray): streaming equals the
in-process engine, concurrency, bad input, cancellation, deadlines, graceful stop, health,
reflection, auth, the CLI, and the draft/target workers behind gRPC."""
from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.frontend.server import SERVICE_NAME
from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from coordinator.frontend.servicer import REQUEST_ID_METADATA
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec.client import GenerationClient
from specdec_app import generate as generate_command
from specdec_app.embedded import GrpcSchedulerFactory, LocalSchedulerFactory
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

from gates import Calls, RoundGate, wait_until
from served_pair import (
    PROMPTS,
    SAMPLED,
    build_pair,
    expected,
    health_status,
    kv_used,
    loading_factory,
    local_reference,
    self_signed_cert,
    service_config,
    serving,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_pair(tmp_path_factory, "srv")


@pytest.fixture(scope="module")
def reference(models):
    return local_reference(models)


@pytest.fixture(scope="module")
def server(models):
    with serving(models) as handle:
        yield handle


@pytest.fixture
def served(server):
    """The module's server, idle: a request an earlier test cancelled has ended (while its abort
    is on the way it still runs rounds, and a gate set then would hold one of those instead)."""
    assert wait_until(lambda: server.scheduler.num_active == 0)
    return server


# --- the embedded server -------------------------------------------------------------------


def test_health_and_reflection(served):
    channel = grpc.insecure_channel(f"127.0.0.1:{served.handle.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    channel.close()


@pytest.mark.parametrize("sampling", [{}, dict(SAMPLED, seed=7)], ids=["greedy", "seeded"])
def test_stream_equals_local_engine(served, reference, sampling):
    for prompt in (PROMPTS[0], [5, 17, 250, 3, 99]):
        want = expected(reference, prompt, **sampling)
        responses = list(served.client.generate_stream(prompt, max_new_tokens=24, **sampling))
        assert len(responses) > 1  # streamed round by round
        assert all(r.finish_reason == "" for r in responses[:-1])
        got_ids = [t for r in responses for t in r.token_ids]
        assert got_ids == want.token_ids
        assert "".join(r.text for r in responses) == want.text
        last = responses[-1]
        assert last.finish_reason == want.finish_reason == "length"
        stats = last.stats
        assert stats.generated_tokens == 24 and stats.prompt_tokens > 0
        assert stats.rounds == stats.target_forward_passes == want.stats.target_forward_passes
        assert stats.draft_forward_passes == want.stats.draft_forward_passes
        assert stats.HasField("acceptance_rate") and stats.acceptance_rate == pytest.approx(want.stats.acceptance_rate)
        assert stats.mean_accepted_length == pytest.approx(24 / stats.rounds)
    assert isinstance(want.text, str) and want.text  # the tokenizer path produced text


def test_greedy_speculative_equals_target_only(served):
    spec = served.client.generate(PROMPTS[2], max_new_tokens=30)
    plain = served.client.generate(PROMPTS[2], max_new_tokens=30, num_speculative_tokens=0)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert not plain.stats.HasField("acceptance_rate") and plain.stats.draft_forward_passes == 0
    assert plain.stats.rounds == 30 and spec.stats.rounds < 30


def test_concurrent_streams_equal_one_at_a_time(served):
    jobs = [(PROMPTS[i % 4], dict(SAMPLED, seed=i) if i % 2 else {}, 16 + i) for i in range(8)]
    widths, tokens_by_request = [], {}
    # The streams overlap whatever the machine's speed: the first concurrent round holds the
    # scheduler until all eight requests reached it (none can finish in one round: K + 1 < 16).
    all_in = RoundGate()

    def record(report):
        widths.append(report.batch_size)
        for update in report.updates:
            tokens_by_request[update.req_id] = tokens_by_request.get(update.req_id, 0) + len(update.token_ids)
        if concurrent_phase.is_set() and not all_in.is_open:
            all_in(report)

    # The hook runs after a round's updates went out: it may still see the last sequential round
    # once the concurrent requests started, so their tokens are told apart by request id.
    concurrent_phase = threading.Event()
    served.scheduler.on_round = record
    try:
        sequential = [served.client.generate(p, max_new_tokens=n, **s) for p, s, n in jobs]
        sequential_ids = set(tokens_by_request)
        widths.clear()
        with Calls(served.scheduler, "submit") as submits, ThreadPoolExecutor(8) as pool:
            concurrent_phase.set()
            running = pool.map(lambda j: served.client.generate(j[0], max_new_tokens=j[2], **j[1]), jobs)
            assert submits.wait_count(len(jobs))
            all_in.open()
            concurrent = list(running)
        # The round reports account for every token of every request (the hook of the last round
        # may run after the clients have their answers).
        concurrent_tokens = lambda: [n for req_id, n in tokens_by_request.items()  # noqa: E731
                                     if req_id not in sequential_ids]
        wait_until(lambda: sum(concurrent_tokens()) >= sum(n for *_, n in jobs))
    finally:
        all_in.open()
        served.scheduler.on_round = None
    for seq, conc in zip(sequential, concurrent):
        assert conc.token_ids == seq.token_ids and conc.text == seq.text and conc.finish_reason == "length"
    assert max(widths) > 1  # they really were batched together
    assert sorted(concurrent_tokens()) == sorted(n for *_, n in jobs)
    assert wait_until(lambda: kv_used(served.factory) == 0)


@pytest.mark.parametrize("prompt,options,message", [
    ("hi", dict(temperature=-1.0), "temperature"),
    ("hi", dict(top_p=0.0), "top_p"),
    ("hi", dict(top_p=1.5), "top_p"),
    ("hi", dict(top_k=-3), "top_k"),
    ("hi", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("hi", dict(max_new_tokens=0), "max_new_tokens"),
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    ([1, 2, 300], {}, "outside the vocabulary"),
    ([1, -2], {}, "outside the vocabulary"),
    ([1] * 100, dict(max_new_tokens=40), "exceeds the context length"),
    ("hi", dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    ("hi", dict(num_speculative_tokens=65), "num_speculative_tokens"),
    ("hi", dict(stop=[""]), "stop"),
])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(served, prompt, options, message):
    with pytest.raises(grpc.RpcError) as info:
        served.client.generate(prompt, **options)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert served.client.generate([1, 2, 3], max_new_tokens=3).finish_reason == "length"


def test_an_accepted_call_names_its_request_in_initial_metadata_before_the_first_token(served):
    gate = RoundGate()
    served.scheduler.on_round = gate
    try:
        call = served.client.generate_stream([4, 8, 15, 16], max_new_tokens=50)
        req_id = dict(call.initial_metadata())[REQUEST_ID_METADATA]
        assert gate.held_request_ids() == [req_id]  # the request the scheduler runs
        call.cancel()
    finally:
        gate.open()
        served.scheduler.on_round = None
    refused = served.client.generate_stream("hi", temperature=-1.0)
    with pytest.raises(grpc.RpcError):
        list(refused)
    assert REQUEST_ID_METADATA not in dict(refused.initial_metadata() or ())


def test_client_cancel_frees_kv_blocks(served):
    # The request cannot finish before the cancel has reached the scheduler: it holds after the
    # first round until then.
    gate = RoundGate()
    served.scheduler.on_round = gate
    try:
        with Calls(served.scheduler, "abort") as aborts:
            call = served.client.generate_stream([4, 8, 15, 16, 23, 42], max_new_tokens=100)
            first = next(call)
            [req_id] = gate.held_request_ids()
            assert first.token_ids and kv_used(served.factory) > 0
            call.cancel()
            assert aborts.wait_first_arg(req_id)
        gate.open()
        assert wait_until(lambda: kv_used(served.factory) == 0)
        assert not served.scheduler.scheduler.running and served.scheduler.num_active == 0
    finally:
        gate.open()
        served.scheduler.on_round = None
    assert served.client.generate("hello", max_new_tokens=4).finish_reason == "length"


def test_deadline_exceeded_frees_kv_blocks(served):
    # The request cannot finish within its deadline: the scheduler holds after its first round
    # until the client has seen DEADLINE_EXCEEDED.
    gate = RoundGate()
    served.scheduler.on_round = gate
    try:
        with pytest.raises(grpc.RpcError) as info:
            served.client.generate([4, 8, 15], max_new_tokens=100, timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open()
        assert wait_until(lambda: kv_used(served.factory) == 0 and not served.scheduler.scheduler.running)
    finally:
        gate.open()
        served.scheduler.on_round = None


def test_stop_string(served, reference):
    full = expected(reference, PROMPTS[1], n=24)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip()
    got = served.client.generate(PROMPTS[1], max_new_tokens=24, stop=[stop])
    assert got.finish_reason == "stop" and got.text == full.text[:full.text.index(stop)]


def test_cli_generate(served, reference):
    want = expected(reference, PROMPTS[3], n=12)
    parser = __import__("argparse").ArgumentParser()
    generate_command.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args([PROMPTS[3], "--address", f"127.0.0.1:{served.handle.port}", "--max-new-tokens", "12",
                              "--stats"])
    with redirect_stdout(out), redirect_stderr(err):
        assert generate_command.run(args) == 0
    assert out.getvalue() == want.text + "\n"
    assert "finish_reason=length" in err.getvalue() and "generated_tokens=12" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert generate_command.run(parser.parse_args(["x", "--address", "127.0.0.1:1"])) == 1
        assert generate_command.run(parser.parse_args(["x", "--address", f"127.0.0.1:{served.handle.port}",
                                                     "--top-p", "2"])) == 1
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("error: server not reachable at 127.0.0.1:1")
    assert lines[1].startswith("error: invalid request: top_p")


# --- servers of their own ------------------------------------------------------------------


def test_graceful_stop_and_auth(models):
    factory = LocalSchedulerFactory(service_config(models))
    with run_server_in_thread(factory, factory.tokenizer, replace(LOOPBACK_SERVER, auth_token="s3cret")) as handle:
        address = f"127.0.0.1:{handle.port}"
        with pytest.raises(grpc.RpcError) as info:
            GenerationClient(address).generate("hi", max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = GenerationClient(address, token="s3cret")
        assert client.generate("hi", max_new_tokens=2).finish_reason == "length"
        # The request is still in flight when the drain starts: it holds after its first round
        # until new requests were seen refused.
        gate = RoundGate()
        handle.server.scheduler.on_round = gate
        call = client.generate_stream([3, 1, 4, 1, 5], max_new_tokens=40)
        first = next(call)
        stopper = threading.Thread(target=handle.stop, args=(60.0,))
        try:
            stopper.start()
            assert wait_until(lambda: handle.server.gate.draining)
            with pytest.raises(grpc.RpcError) as info:
                client.generate("hi", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            gate.open()
        rest = list(call)  # the in-flight request runs to its end
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 40
        stopper.join(60)
        assert not stopper.is_alive()
        assert kv_used(factory) == 0
        client.close()


def test_workers_over_grpc(models, reference):
    config = service_config(models, worker_recovery_timeout=1.0)
    target_worker, draft_worker = TargetWorker.from_config(config.target), DraftWorker.from_config(config.draft)
    tserver, tport = target_server.serve(target_worker)
    dserver, dport = draft_server.serve(draft_worker)
    try:
        factory = GrpcSchedulerFactory(config, f"127.0.0.1:{tport}", f"127.0.0.1:{dport}")
        with run_server_in_thread(factory, factory.tokenizer) as handle:
            client = GenerationClient(f"127.0.0.1:{handle.port}")
            for sampling in ({}, dict(SAMPLED, seed=3)):
                want = expected(reference, PROMPTS[0], **sampling)
                got = client.generate(PROMPTS[0], max_new_tokens=24, **sampling)
                assert got.token_ids == want.token_ids and got.text == want.text
                assert got.stats.rounds == want.stats.target_forward_passes
            for counter in factory.wire.values():  # two rounds' worth at least, each way
                assert counter.rounds >= 2 and counter.bytes_sent > 0 and counter.bytes_received > 0
            assert wait_until(lambda: target_worker.cache.allocator.num_used == 0)
            tserver.stop(None)  # the target goes away for good: requests wait for it, then fail
            with pytest.raises(grpc.RpcError) as info:
                client.generate(PROMPTS[0], max_new_tokens=8)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unavailable for longer than 1s" in info.value.details()
            client.close()
        factory.close()
    finally:
        tserver.stop(None)
        dserver.stop(None)


def test_not_serving_until_ready_and_requests_wait(models, reference):
    factory = LocalSchedulerFactory(service_config(models))
    gate, slow_factory = loading_factory(factory)
    with run_server_in_thread(slow_factory, factory.tokenizer, wait_ready=False) as handle:
        assert health_status(handle.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        client = GenerationClient(f"127.0.0.1:{handle.port}")
        with Calls(handle.server.scheduler, "submit") as submits, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, PROMPTS[0], max_new_tokens=8)
            assert submits.wait_count(1)  # queued while loading
            assert not pending.done()
            gate.set()
            assert pending.result(10).token_ids == expected(reference, PROMPTS[0], n=8).token_ids
        assert wait_until(lambda: health_status(handle.port) == health_pb2.HealthCheckResponse.SERVING)
        client.close()


def test_engine_start_failure_is_unavailable():
    def broken():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with run_server_in_thread(broken, None, wait_ready=False) as handle:
        assert wait_until(lambda: handle.server.scheduler.ready.is_set())
        assert health_status(handle.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with GenerationClient(f"127.0.0.1:{handle.port}") as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate([1, 2], max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "no checkpoint" in info.value.details()


def test_tls(models, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    factory = LocalSchedulerFactory(service_config(models, draft=None))
    tls = replace(LOOPBACK_SERVER, tls_cert=str(cert), tls_key=str(key))
    with run_server_in_thread(factory, factory.tokenizer, tls) as handle:
        with GenerationClient(f"127.0.0.1:{handle.port}", tls_ca=str(cert)) as client:
            assert len(client.generate([1, 2, 3], max_new_tokens=3).token_ids) == 3
        with GenerationClient(f"127.0.0.1:{handle.port}") as plain:
            with pytest.raises(grpc.RpcError) as info:
                plain.generate([1, 2, 3], max_new_tokens=3, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
