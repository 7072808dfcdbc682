"""Real gRPC worker servers on 127.0.0.1 with fake workers: rounds, errors, byte counts, outages."""
import socket

import pytest
import torch

from coordinator.rounds.errors import WorkerInternalError, WorkerInvalidArgument, WorkerUnavailable
from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
from draft_worker import grpc_server as draft_server
from specdec import wire
from specdec.params import SamplingParams
from specdec.round_types import (
    DraftInfo,
    DraftProposal,
    DraftTask,
    SparseDist,
    TargetInfo,
    VerifyOutcome,
    VerifyResult,
    VerifyTask,
)
from target_worker import grpc_server as target_server

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=1)


def q_for(k: int) -> SparseDist:
    dense = torch.softmax(torch.randn(k, 64, generator=torch.Generator().manual_seed(k)), dim=-1)
    dense[dense < 0.01] = 0
    return SparseDist.from_dense(dense / dense.sum(-1, keepdim=True))


class FakeDraft:
    """Proposes k copies of len(new_tokens); req_id "bad" -> ValueError, "boom" -> RuntimeError."""

    def __init__(self):
        self.finished: list[str] = []

    def info(self):
        return DraftInfo("ngram", extra={"fake": True})

    def propose(self, tasks, finished):
        self.finished += finished
        for t in tasks:
            if t.req_id == "bad":
                raise ValueError("k too large for request bad")
            if t.req_id == "boom":
                raise RuntimeError("draft exploded")
        return [DraftProposal(t.req_id, [len(t.new_tokens)] * t.num_speculative_tokens,
                              None if t.params.greedy else q_for(t.num_speculative_tokens),
                              t.num_speculative_tokens) for t in tasks]


class FakeTarget:
    """Accepts every draft token and adds a bonus token 99; req_id "bad"/"boom" as in FakeDraft."""

    def __init__(self):
        self.finished: list[str] = []
        self.seen_q: dict[str, SparseDist | None] = {}

    def info(self):
        return TargetInfo(vocab_size=64, max_seq_len=256, eos_token_ids=[2], kv_block_size=16, kv_blocks_total=32)

    def verify(self, tasks, finished):
        self.finished += finished
        for t in tasks:
            if t.req_id == "bad":
                raise ValueError("draft tokens out of vocabulary")
            if t.req_id == "boom":
                raise RuntimeError("target exploded")
            self.seen_q[t.req_id] = t.q
        outcomes = [VerifyOutcome(t.req_id, len(t.draft_tokens), t.draft_tokens + [99]) for t in tasks]
        return VerifyResult(outcomes, kv_blocks_used=len(tasks), kv_blocks_total=32)


@pytest.fixture
def draft():
    worker = FakeDraft()
    server, port = draft_server.serve(worker)
    client = GrpcDraftClient(f"127.0.0.1:{port}")
    yield worker, client, server
    client.close()
    server.stop(grace=None)


@pytest.fixture
def target():
    worker = FakeTarget()
    server, port = target_server.serve(worker)
    client = GrpcTargetClient(f"127.0.0.1:{port}")
    yield worker, client, server
    client.close()
    server.stop(grace=None)


def test_propose_round_trips_on_one_stream_and_counts_bytes(draft):
    worker, client, _ = draft
    assert client.info() == DraftInfo("ngram", extra={"fake": True})
    tasks = [DraftTask("a", [1, 2, 3], 4, SAMPLED), DraftTask("b", [5], 2, GREEDY)]
    proposals = client.propose(tasks, finished=["old"])
    assert [(p.req_id, p.tokens, p.draft_forward_passes) for p in proposals] == [("a", [3] * 4, 4), ("b", [1, 1], 2)]
    assert torch.equal(proposals[0].q.to_dense(64), q_for(4).to_dense(64)) and proposals[1].q is None
    assert worker.finished == ["old"]

    request = wire.draft_round_to_proto(tasks, ["old"])
    reply = wire.draft_reply_to_proto(proposals)
    assert (client.wire.rounds, client.wire.bytes_sent, client.wire.bytes_received) == \
        (1, request.ByteSize(), reply.ByteSize())

    stream = client._call
    second = [DraftTask("a", [7], 1, GREEDY)]
    second_reply = wire.draft_reply_to_proto(client.propose(second, finished=[]))
    assert client._call is stream, "rounds must reuse the open stream"
    assert client.wire.rounds == 2
    assert client.wire.bytes_sent == request.ByteSize() + wire.draft_round_to_proto(second, []).ByteSize()
    assert client.wire.bytes_received == reply.ByteSize() + second_reply.ByteSize()


def test_verify_round_trips(target):
    worker, client, _ = target
    assert client.info().kv_blocks_total == 32
    q = q_for(2)
    result = client.verify([VerifyTask("a", [1, 2], [5, 6], q, SAMPLED), VerifyTask("b", [], [], None, GREEDY)], ["z"])
    assert result == VerifyResult([VerifyOutcome("a", 2, [5, 6, 99]), VerifyOutcome("b", 0, [99])], 2, 32)
    assert torch.equal(worker.seen_q["a"].to_dense(64), q.to_dense(64)) and worker.seen_q["b"] is None
    assert worker.finished == ["z"]
    assert client.wire.rounds == 1 and client.wire.bytes_sent > 0 and client.wire.bytes_received > 0


@pytest.mark.parametrize("side", ["draft", "target"])
def test_worker_errors_become_statuses_and_serving_continues(side, request):
    _, client, _ = request.getfixturevalue(side)

    def run(req_id):
        if side == "draft":
            return client.propose([DraftTask(req_id, [1], 2, GREEDY)], [])
        return client.verify([VerifyTask(req_id, [1], [3], None, GREEDY)], [])

    run("ok")
    with pytest.raises(WorkerInvalidArgument) as bad:
        run("bad")
    assert isinstance(bad.value, ValueError) and bad.value.code == "INVALID_ARGUMENT"
    assert "bad" in str(bad.value) or "vocabulary" in str(bad.value)
    with pytest.raises(WorkerInternalError) as boom:
        run("boom")
    assert boom.value.code == "INTERNAL" and "RuntimeError" in str(boom.value) and "exploded" in str(boom.value)
    assert run("ok")  # a fresh stream; the server kept serving
    assert (client.info().kind if side == "draft" else client.info().vocab_size)


def test_stopped_worker_raises_unavailable_then_recovers_on_restart(draft):
    _, client, server = draft
    port = int(client.address.rsplit(":", 1)[1])
    client.propose([DraftTask("a", [1], 1, GREEDY)], [])
    server.stop(grace=None).wait()
    with pytest.raises(WorkerUnavailable):
        client.propose([DraftTask("a", [1], 1, GREEDY)], [])

    new_server, new_port = draft_server.serve(FakeDraft(), address=f"127.0.0.1:{port}")
    try:
        assert new_port == port
        client.wait_ready(timeout_s=10)
        assert client.propose([DraftTask("a", [1, 2], 1, GREEDY)], [])[0].tokens == [2]
    finally:
        new_server.stop(grace=None)


def test_unreachable_worker_raises_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with GrpcTargetClient(f"127.0.0.1:{port}") as client:
        with pytest.raises(WorkerUnavailable):
            client.verify([VerifyTask("a", [1], [2], None, GREEDY)], [])
        with pytest.raises(WorkerUnavailable):
            client.info(timeout_s=2)
        with pytest.raises(WorkerUnavailable):
            client.wait_ready(timeout_s=0.2)


def test_closed_client_raises_unavailable(draft):
    _, client, _ = draft
    client.close()
    with pytest.raises(WorkerUnavailable):
        client.propose([], [])
