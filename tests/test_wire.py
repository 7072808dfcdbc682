"""Round-trip the in-process round messages through protobuf (and bytes) unchanged."""
import math

import pytest
import torch

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
from specdec.v1 import generation_pb2, worker_pb2


def through_bytes(msg):
    return type(msg).FromString(msg.SerializeToString())


def ragged_q(vocab=1000, k=4, seed=0) -> tuple[SparseDist, torch.Tensor]:
    """A q whose rows have different supports (as top-k/top-p truncation gives), padded by from_dense."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.softmax(torch.randn(k, vocab, generator=g) * 3, dim=-1)
    for i in range(k):
        keep = torch.randperm(vocab, generator=g)[: 5 + 60 * i]
        row = torch.zeros(vocab)
        row[keep] = dense[i, keep]
        dense[i] = row / row.sum()
    return SparseDist.from_dense(dense), dense


def test_sampling_params_round_trip_exact():
    for p in [
        SamplingParams(),
        SamplingParams(max_new_tokens=7, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1,
                       seed=2**64 - 1, stop=("\n\n", "END"), ignore_eos=True),
        SamplingParams(temperature=1 / 3, seed=0),
    ]:
        assert wire.params_from_proto(through_bytes(wire.params_to_proto(p))) == p


def test_invalid_params_on_the_wire_raise_value_error():
    with pytest.raises(ValueError):
        wire.params_from_proto(worker_pb2.SamplingParams())  # max_new_tokens 0, top_p 0


def test_sparse_q_is_bit_exact_and_drops_only_zeros():
    q, dense = ragged_q()
    msg = through_bytes(wire.sparse_to_proto(q))
    assert list(msg.row_lengths) == [int((dense[i] > 0).sum()) for i in range(4)]
    back = wire.sparse_from_proto(msg)
    assert back.token_ids.dtype == torch.int64 and back.probs.dtype == torch.float32
    assert back.token_ids.shape == q.token_ids.shape
    assert torch.equal(back.to_dense(1000), q.to_dense(1000))  # bitwise, not approximately
    # Every real (token, prob) pair comes back exactly; padding never repeats a token in its row.
    for i in range(4):
        sent = {(t, p) for t, p in zip(q.token_ids[i].tolist(), q.probs[i].tolist()) if p != 0}
        got = list(zip(back.token_ids[i].tolist(), back.probs[i].tolist()))
        assert {(t, p) for t, p in got if p != 0} == sent
        assert len({t for t, _ in got}) == len(got)
        assert all(0 <= t < 1000 for t, _ in got)


def test_sparse_q_awkward_fp32_values_survive():
    # Subnormal, non-representable decimal, largest float below 0.5; row 0 is padded on return
    # (its zero is dropped on the wire and row 1 is wider).
    probs = torch.tensor([[1e-45, 0.1, float.fromhex("0x1.fffffep-2"), 0.0],
                          [0.25, 0.25, 0.25, 0.25]], dtype=torch.float32)
    q = SparseDist(token_ids=torch.tensor([[128_255, 3, 0, 7], [1, 2, 3, 4]]), probs=probs)
    back = wire.sparse_from_proto(through_bytes(wire.sparse_to_proto(q)))
    assert torch.equal(back.probs, probs) and back.token_ids[0, :3].tolist() == [128_255, 3, 0]
    assert back.token_ids[0, 3].item() not in (128_255, 3, 0)
    assert torch.equal(back.token_ids[1], q.token_ids[1])


def test_sparse_q_full_rows_and_empty():
    q = SparseDist(token_ids=torch.tensor([[5, 2], [9, 1]]), probs=torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    back = wire.sparse_from_proto(wire.sparse_to_proto(q))
    assert torch.equal(back.token_ids, q.token_ids) and torch.equal(back.probs, q.probs)
    empty = SparseDist(token_ids=torch.zeros(0, 1, dtype=torch.int64), probs=torch.zeros(0, 1))
    assert wire.sparse_from_proto(wire.sparse_to_proto(empty)).num_positions == 0


def test_malformed_sparse_q_raises_value_error():
    with pytest.raises(ValueError):
        wire.sparse_from_proto(worker_pb2.SparseDist(row_lengths=[2], token_ids=b"\0" * 4, probs=b"\0" * 8))


def test_draft_round_round_trip():
    q, _ = ragged_q(k=3)
    params = SamplingParams(temperature=0.8, seed=5)
    tasks = [DraftTask("a", [1, 2, 3], 4, params), DraftTask("b", [], 0, SamplingParams()),
             DraftTask("t", [9], 3, params, branches=3, side_depth=1)]
    got_tasks, got_finished = wire.draft_round_from_proto(through_bytes(wire.draft_round_to_proto(tasks, ["x", "y"])))
    assert got_tasks == tasks and got_finished == ["x", "y"]

    zero_rows = SparseDist(token_ids=torch.zeros(0, 1, dtype=torch.int64), probs=torch.zeros(0, 1))
    proposals = [DraftProposal("a", [4, 5, 6], q, 3), DraftProposal("b", [], None, 0),
                 DraftProposal("c", [], zero_rows), DraftProposal("t", [4, 5, 6], q, 2, parents=[-1, 0, -1])]
    back = wire.draft_reply_from_proto(through_bytes(wire.draft_reply_to_proto(proposals)))
    assert [(p.req_id, p.tokens, p.draft_forward_passes, p.parents) for p in back] == [
        ("a", [4, 5, 6], 3, []), ("b", [], 0, []), ("c", [], 0, []), ("t", [4, 5, 6], 2, [-1, 0, -1])
    ]
    assert torch.equal(back[0].q.to_dense(1000), q.to_dense(1000))
    assert back[1].q is None  # greedy: no q at all
    assert back[2].q is not None and back[2].q.num_positions == 0  # present-but-empty stays present


def test_verify_round_round_trip():
    q, _ = ragged_q(k=2)
    params = SamplingParams(temperature=1.0, top_k=50)
    tasks = [VerifyTask("a", [10, 11], [4, 5], q, params), VerifyTask("b", [], [7], None, SamplingParams()),
             VerifyTask("t", [], [7, 8], None, SamplingParams(), parents=[-1, -1])]
    got, finished = wire.verify_round_from_proto(through_bytes(wire.verify_round_to_proto(tasks, [])))
    assert finished == []
    assert [(t.req_id, t.new_tokens, t.draft_tokens, t.params, t.parents) for t in got] == [
        (t.req_id, t.new_tokens, t.draft_tokens, t.params, t.parents) for t in tasks
    ]
    assert torch.equal(got[0].q.to_dense(1000), q.to_dense(1000)) and got[1].q is None

    result = VerifyResult([VerifyOutcome("a", 2, [4, 5, 9]), VerifyOutcome("b", 0, [3])],
                          kv_blocks_used=7, kv_blocks_total=64)
    assert wire.verify_reply_from_proto(through_bytes(wire.verify_reply_to_proto(result))) == result


def test_infos_round_trip():
    t = TargetInfo(vocab_size=128_256, max_seq_len=8192, eos_token_ids=[128_001, 128_009], kv_block_size=16,
                   kv_blocks_total=4096, model_name="llama-3b")
    assert wire.target_info_from_proto(through_bytes(wire.target_info_to_proto(t))) == t
    for d in [DraftInfo("ngram"), DraftInfo("model", 128_256, 8192, {"layers": 16, "name": "1b"})]:
        assert wire.draft_info_from_proto(through_bytes(wire.draft_info_to_proto(d))) == d


def test_generate_request_defaults_and_overrides():
    params, k = wire.params_from_generate_request(generation_pb2.GenerateRequest(prompt="hi"))
    assert params == SamplingParams() and k is None

    req = generation_pb2.GenerateRequest(
        max_new_tokens=5, stop=["."], ignore_eos=True, num_speculative_tokens=0,
        sampling=generation_pb2.SamplingOptions(temperature=0.9, top_k=3, top_p=0.95, repetition_penalty=1.2, seed=7),
    )
    params, k = wire.params_from_generate_request(through_bytes(req))
    assert k == 0
    assert params == SamplingParams(max_new_tokens=5, temperature=0.9, top_k=3, top_p=0.95,
                                    repetition_penalty=1.2, seed=7, stop=(".",), ignore_eos=True)
    assert math.isclose(params.top_p, 0.95) and params.top_p == 0.95  # doubles: no float32 rounding

    for bad in [generation_pb2.GenerateRequest(max_new_tokens=0),
                generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingOptions(top_p=0.0)),
                generation_pb2.GenerateRequest(num_speculative_tokens=-1)]:
        with pytest.raises(ValueError):
            wire.params_from_generate_request(bad)
