"""Conversions between the in-process round messages (round_types, params) and protobuf.

The mapping is one to one, so a round run over gRPC sees exactly what an in-process round sees.
Two deliberate choices:
- q travels as flat little-endian int32/float32 bytes with per-row lengths (see SparseDist in
  protos/specdec/v1/worker.proto): bit-exact, and fast to convert. Zero-probability entries are
  dropped on the way out; they carry no mass, so the dense q is unchanged.
- Sampling floats are doubles on the wire: both workers must see the coordinator's exact values.
"""
from __future__ import annotations

import json

import numpy as np
import torch

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

# Generous limits: a first round carries whole prompts, and a wide q can reach megabytes.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Shared by worker servers and clients. Keepalive lets a client notice a silently dead peer
# (a node gone from the network) instead of blocking on a round forever; the server must allow
# pings at that rate or it would close the connection with "too_many_pings".
GRPC_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)
GRPC_SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Fail loudly on a port already in use instead of silently sharing it with another server.
    ("grpc.so_reuseport", 0),
)


# --- sampling parameters -------------------------------------------------------------------


def params_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    msg = worker_pb2.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        repetition_penalty=p.repetition_penalty,
        stop=p.stop,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def params_from_proto(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError on invalid values (SamplingParams validates itself)."""
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        repetition_penalty=msg.repetition_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
    )


def params_from_generate_request(req: generation_pb2.GenerateRequest) -> tuple[SamplingParams, int | None]:
    """Public request -> (SamplingParams, num_speculative_tokens or None for the server default).

    Unset fields take SamplingParams' defaults (max_new_tokens 64, greedy, top_p 1.0, no
    repetition penalty), as documented in generation.proto. Raises ValueError on bad values.
    """
    kwargs: dict = {"top_k": req.sampling.top_k, "stop": tuple(req.stop), "ignore_eos": req.ignore_eos}
    if req.HasField("max_new_tokens"):
        kwargs["max_new_tokens"] = req.max_new_tokens
    for name in ("temperature", "top_p", "repetition_penalty", "seed"):
        if req.sampling.HasField(name):
            kwargs[name] = getattr(req.sampling, name)
    params = SamplingParams(**kwargs)
    k = req.num_speculative_tokens if req.HasField("num_speculative_tokens") else None
    if k is not None and k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0 (0 disables speculation), got {k}")
    return params, k


# --- sparse q ------------------------------------------------------------------------------


def sparse_to_proto(q: SparseDist, out: worker_pb2.SparseDist | None = None) -> worker_pb2.SparseDist:
    """Encode q (into `out` if given, saving a copy of the bytes)."""
    ids = q.token_ids.detach().cpu().numpy()
    probs = q.probs.detach().cpu().float().numpy()
    if ids.ndim != 2 or ids.shape != probs.shape:
        raise ValueError(f"SparseDist needs matching [k, n] arrays, got {ids.shape} and {probs.shape}")
    keep = probs != 0  # drops padding; NaN and negatives pass, so the receiver can reject them
    if out is None:
        out = worker_pb2.SparseDist()
    else:
        out.SetInParent()  # a q with zero rows must still arrive as "present", not as None
    out.row_lengths.extend(keep.sum(axis=1).tolist())
    out.token_ids = ids[keep].astype("<i4").tobytes()
    out.probs = probs[keep].astype("<f4", copy=False).tobytes()
    return out


def sparse_from_proto(msg: worker_pb2.SparseDist) -> SparseDist:
    """Rebuild the padded [k, n] form. Padding entries get probability 0 and token ids not used
    elsewhere in their row, so a row never lists the same token twice. numpy, not torch: a few
    small array ops, where torch's per-op overhead would dominate."""
    lengths = np.asarray(msg.row_lengths, dtype=np.int64)
    total = int(lengths.sum())
    if (lengths < 0).any() or len(msg.token_ids) != 4 * total or len(msg.probs) != 4 * total:
        raise ValueError(
            f"malformed SparseDist: row_lengths sum to {total} but got {len(msg.token_ids)} id bytes "
            f"and {len(msg.probs)} prob bytes (4 per entry)"
        )
    ids = np.frombuffer(msg.token_ids, dtype="<i4").astype(np.int64)
    flat_probs = np.frombuffer(msg.probs, dtype="<f4").astype(np.float32)
    k, width = len(lengths), max(1, int(lengths.max(initial=0)))
    if total == k * width:  # every row full: no padding to invent
        return SparseDist(token_ids=torch.from_numpy(ids.reshape(k, width)),
                          probs=torch.from_numpy(flat_probs.reshape(k, width)))
    rows = np.repeat(np.arange(k), lengths)
    cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    token_ids = np.zeros((k, width), dtype=np.int64)
    probs = np.zeros((k, width), dtype=np.float32)
    token_ids[rows, cols] = ids
    probs[rows, cols] = flat_probs
    # Padding ids: per row, the smallest ids in [0, width) that the row does not use. A row uses
    # at most its length of them, so enough remain. Stable argsort puts the unused ones first.
    used = np.zeros((k, width + 1), dtype=bool)
    used[rows, np.where((ids >= 0) & (ids < width), ids, width)] = True
    free_first = np.argsort(used[:, :width], axis=1, kind="stable")
    pos = np.arange(width)[None, :] - lengths[:, None]  # index into the row's padding, < 0 = real
    pad_ids = np.take_along_axis(free_first, np.maximum(pos, 0), axis=1)
    token_ids = np.where(pos >= 0, pad_ids, token_ids)
    return SparseDist(token_ids=torch.from_numpy(token_ids), probs=torch.from_numpy(probs))


def _optional_sparse(msg, field: str) -> SparseDist | None:
    return sparse_from_proto(getattr(msg, field)) if msg.HasField(field) else None


# --- draft round ---------------------------------------------------------------------------


def draft_task_to_proto(t: DraftTask) -> worker_pb2.DraftTask:
    return worker_pb2.DraftTask(req_id=t.req_id, new_tokens=t.new_tokens,
                                num_speculative_tokens=t.num_speculative_tokens, params=params_to_proto(t.params),
                                assumed_tokens=t.assumed_tokens, branches=t.branches, side_depth=t.side_depth)


def draft_task_from_proto(msg: worker_pb2.DraftTask) -> DraftTask:
    return DraftTask(req_id=msg.req_id, new_tokens=list(msg.new_tokens),
                     num_speculative_tokens=msg.num_speculative_tokens, params=params_from_proto(msg.params),
                     assumed_tokens=list(msg.assumed_tokens), branches=max(1, msg.branches),
                     side_depth=max(0, msg.side_depth))


def draft_proposal_to_proto(p: DraftProposal) -> worker_pb2.DraftProposal:
    msg = worker_pb2.DraftProposal(req_id=p.req_id, tokens=p.tokens, draft_forward_passes=p.draft_forward_passes,
                                   parents=p.parents)
    if p.q is not None:
        sparse_to_proto(p.q, out=msg.q)
    return msg


def draft_proposal_from_proto(msg: worker_pb2.DraftProposal) -> DraftProposal:
    return DraftProposal(
        req_id=msg.req_id,
        tokens=list(msg.tokens),
        q=_optional_sparse(msg, "q"),
        draft_forward_passes=msg.draft_forward_passes,
        parents=list(msg.parents),
    )


def draft_round_to_proto(tasks: list[DraftTask], finished: list[str]) -> worker_pb2.DraftRoundRequest:
    return worker_pb2.DraftRoundRequest(tasks=[draft_task_to_proto(t) for t in tasks], finished=list(finished))


def draft_round_from_proto(msg: worker_pb2.DraftRoundRequest) -> tuple[list[DraftTask], list[str]]:
    return [draft_task_from_proto(t) for t in msg.tasks], list(msg.finished)


def draft_reply_to_proto(proposals: list[DraftProposal]) -> worker_pb2.DraftRoundReply:
    return worker_pb2.DraftRoundReply(proposals=[draft_proposal_to_proto(p) for p in proposals])


def draft_reply_from_proto(msg: worker_pb2.DraftRoundReply) -> list[DraftProposal]:
    return [draft_proposal_from_proto(p) for p in msg.proposals]


def draft_info_to_proto(info: DraftInfo) -> worker_pb2.DraftInfo:
    msg = worker_pb2.DraftInfo(kind=info.kind, extra_json=json.dumps(info.extra, sort_keys=True) if info.extra else "")
    if info.vocab_size is not None:
        msg.vocab_size = info.vocab_size
    if info.max_seq_len is not None:
        msg.max_seq_len = info.max_seq_len
    return msg


def draft_info_from_proto(msg: worker_pb2.DraftInfo) -> DraftInfo:
    return DraftInfo(
        kind=msg.kind,
        vocab_size=msg.vocab_size if msg.HasField("vocab_size") else None,
        max_seq_len=msg.max_seq_len if msg.HasField("max_seq_len") else None,
        extra=json.loads(msg.extra_json) if msg.extra_json else {},
    )


# --- verify round --------------------------------------------------------------------------


def verify_task_to_proto(t: VerifyTask) -> worker_pb2.VerifyTask:
    msg = worker_pb2.VerifyTask(
        req_id=t.req_id, new_tokens=t.new_tokens, draft_tokens=t.draft_tokens, params=params_to_proto(t.params),
        parents=t.parents,
    )
    if t.q is not None:
        sparse_to_proto(t.q, out=msg.q)
    return msg


def verify_task_from_proto(msg: worker_pb2.VerifyTask) -> VerifyTask:
    return VerifyTask(
        req_id=msg.req_id,
        new_tokens=list(msg.new_tokens),
        draft_tokens=list(msg.draft_tokens),
        q=_optional_sparse(msg, "q"),
        params=params_from_proto(msg.params),
        parents=list(msg.parents),
    )


def verify_result_to_proto(r: VerifyResult) -> worker_pb2.VerifyResult:
    outcomes = [worker_pb2.VerifyOutcome(req_id=o.req_id, num_accepted=o.num_accepted, tokens=o.tokens, error=o.error)
                for o in r.outcomes]
    return worker_pb2.VerifyResult(outcomes=outcomes, kv_blocks_used=r.kv_blocks_used,
                                   kv_blocks_total=r.kv_blocks_total)


def verify_result_from_proto(msg: worker_pb2.VerifyResult) -> VerifyResult:
    outcomes = [VerifyOutcome(req_id=o.req_id, num_accepted=o.num_accepted, tokens=list(o.tokens), error=o.error)
                for o in msg.outcomes]
    return VerifyResult(outcomes=outcomes, kv_blocks_used=msg.kv_blocks_used, kv_blocks_total=msg.kv_blocks_total)


def verify_round_to_proto(tasks: list[VerifyTask], finished: list[str]) -> worker_pb2.VerifyRoundRequest:
    return worker_pb2.VerifyRoundRequest(tasks=[verify_task_to_proto(t) for t in tasks], finished=list(finished))


def verify_round_from_proto(msg: worker_pb2.VerifyRoundRequest) -> tuple[list[VerifyTask], list[str]]:
    return [verify_task_from_proto(t) for t in msg.tasks], list(msg.finished)


def verify_reply_to_proto(result: VerifyResult) -> worker_pb2.VerifyRoundReply:
    return worker_pb2.VerifyRoundReply(result=verify_result_to_proto(result))


def verify_reply_from_proto(msg: worker_pb2.VerifyRoundReply) -> VerifyResult:
    return verify_result_from_proto(msg.result)


def target_info_to_proto(info: TargetInfo) -> worker_pb2.TargetInfo:
    return worker_pb2.TargetInfo(
        vocab_size=info.vocab_size,
        max_seq_len=info.max_seq_len,
        eos_token_ids=info.eos_token_ids,
        kv_block_size=info.kv_block_size,
        kv_blocks_total=info.kv_blocks_total,
        model_name=info.model_name,
        num_parameters=info.num_parameters,
    )


def target_info_from_proto(msg: worker_pb2.TargetInfo) -> TargetInfo:
    return TargetInfo(
        vocab_size=msg.vocab_size,
        max_seq_len=msg.max_seq_len,
        eos_token_ids=list(msg.eos_token_ids),
        kv_block_size=msg.kv_block_size,
        kv_blocks_total=msg.kv_blocks_total,
        model_name=msg.model_name,
        num_parameters=msg.num_parameters,
    )
