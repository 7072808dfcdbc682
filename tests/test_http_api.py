"""The OpenAI-compatible HTTP API end to end on 127.0.0.1, driven by the official `openai` package
and raw httpx: outputs equal LocalEngine's (completions and chat, streamed and not, greedy and
seeded), usage, Server-Sent Events framing, every error in OpenAI's shape, /health, /metrics,
and a client that disconnects freeing its KV blocks. Servers of their own (readiness, draining,
no chat template, HTTPS) are in test_http_api_servers.py.

The served model is a random checkpoint whose tokenizer has a chat template (tests/http_pair.py);
the server runs the default adaptive speculation policy and so does the reference engine: greedy
output does not depend on K, and a seeded request's K depends only on its own history, so outputs
must match.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from coordinator.telemetry.prometheus_metrics import PrometheusMetrics
from specdec import LocalEngine
from specdec.params import SamplingParams
from specdec_app.embedded import LocalSchedulerFactory

from gates import Calls, RoundGate, wait_until
from http_pair import CHAT, IDS, PROMPT, TOKEN, http_config, http_pair
from served_pair import KV, kv_used

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, seed=7)
OPENAI_SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 40})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return http_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(models):
    return LocalEngine(config=http_config(models))


@pytest.fixture(scope="module")
def served(models):
    factory = LocalSchedulerFactory(http_config(models))
    with run_server_in_thread(factory, factory.tokenizer, replace(LOOPBACK_SERVER, auth_token=TOKEN)) as handle:
        base = f"http://127.0.0.1:{handle.http_port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        yield SimpleNamespace(handle=handle, base=base, client=client, factory=factory, model=models.target,
                              scheduler=handle.server.scheduler, headers={"Authorization": f"Bearer {TOKEN}"})
        client.close()


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.body if isinstance(exc.body, dict) else json.loads(exc.response.text)
    return body.get("error", body)


def sse_events(response: httpx.Response) -> list:
    """The decoded `data:` payloads of an SSE body (the final "[DONE]" as the string)."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --- models, health ----------------------------------------------------------------------------


def test_models_and_health(served):
    assert httpx.get(f"{served.base}/health").json() == {"status": "ok"}  # no token needed
    models = served.client.models.list().data
    assert [m.id for m in models] == [served.model] and models[0].object == "model"
    assert served.client.models.retrieve(Path(served.model).name).id == served.model  # the basename is accepted
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-4")


# --- outputs equal LocalEngine's ---------------------------------------------------------------


@pytest.mark.parametrize("sampling,openai_sampling", [
    (dict(temperature=0.0), dict(temperature=0)),
    (SAMPLED, OPENAI_SAMPLED),
    (dict(temperature=1.0, seed=5), dict(seed=5)),  # unset temperature is OpenAI's 1.0
], ids=["greedy", "seeded", "default-temperature"])
@pytest.mark.parametrize("prompt", [PROMPT, IDS], ids=["text", "token-ids"])
def test_completions_equal_local_engine(served, reference, prompt, sampling, openai_sampling):
    want = reference.generate([prompt], SamplingParams(max_new_tokens=20, **sampling))[0]
    assert want.text  # the comparison is not between empty strings
    prompt_tokens = len(reference.encode(prompt))
    got = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=20, **openai_sampling)
    assert got.object == "text_completion" and len(got.choices) == 1
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        prompt_tokens, 20, prompt_tokens + 20)

    chunks = list(served.client.completions.create(model=served.model, prompt=prompt, max_tokens=20, stream=True,
                                                   stream_options={"include_usage": True}, **openai_sampling))
    *deltas, usage_chunk = chunks
    assert len(deltas) > 1  # streamed round by round
    assert "".join(c.choices[0].text for c in deltas) == want.text
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("sampling,openai_sampling", [(dict(temperature=0.0), dict(temperature=0)),
                                                      (SAMPLED, OPENAI_SAMPLED)], ids=["greedy", "seeded"])
def test_chat_completions_equal_local_engine(served, reference, sampling, openai_sampling):
    want = reference.chat([CHAT], SamplingParams(max_new_tokens=16, **sampling))[0]
    assert want.text
    got = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=16, **openai_sampling)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 16

    chunks = list(served.client.chat.completions.create(model=served.model, messages=CHAT, stream=True,
                                                        max_completion_tokens=16, **openai_sampling))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_sse_framing_and_stop_strings(served, reference):
    full = reference.generate([PROMPT], SamplingParams(max_new_tokens=24))[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip()
    body = dict(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never seen"],
                stream=True, stream_options={"include_usage": True})
    response = httpx.post(f"{served.base}/v1/completions", json=body, headers=served.headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.index(stop)]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert len({c["id"] for c in events[:-1]}) == 1 and usage["choices"] == []
    assert set(usage["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    single = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                              stop=stop)
    assert single.choices[0].text == full[:full.index(stop)] and single.choices[0].finish_reason == "stop"
    assert single.usage.completion_tokens == usage["usage"]["completion_tokens"] < 24


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,changes,param,message", [
    ("completions", dict(n=2), "n", "n must be 1"),
    ("completions", dict(temperature=-1), "temperature", "temperature must be a finite number >= 0"),
    ("completions", dict(temperature="hot"), "temperature", "invalid temperature"),
    ("completions", dict(top_p=0), "top_p", "top_p must be in (0, 1]"),
    ("completions", dict(top_k=-2), "top_k", "top_k must be an integer >= 0"),
    ("completions", dict(max_tokens=0), "max_tokens", "max_tokens must be a positive integer"),
    ("completions", dict(seed=-1), "seed", "seed must be an integer"),
    ("completions", dict(stop=[""]), "stop", "stop strings must be non-empty"),
    ("completions", dict(stream="maybe"), "stream", "invalid stream"),
    ("completions", dict(prompt=["one", "two"]), "prompt", "batches of prompts are not supported"),
    ("completions", dict(prompt=[[1, 2], [3]]), "prompt", "batches of prompts are not supported"),
    ("completions", dict(prompt=5), "prompt", "invalid prompt: expected str or list[int]"),
    ("completions", dict(prompt=""), "prompt", "the prompt is empty"),
    ("completions", dict(prompt=[]), "prompt", "the prompt is empty"),
    ("completions", dict(prompt=[1, 2, 300]), None, "outside the vocabulary"),
    ("completions", dict(prompt=[1] * 100, max_tokens=40), "max_tokens", "exceeds the context length"),
    ("completions", dict(prompt=[1] * 100, max_tokens=40, stream=True), "max_tokens", "exceeds the context length"),
    ("completions", dict(model=None), "model", "model is required"),
    ("chat/completions", dict(messages=[]), "messages", "messages is empty"),
    ("chat/completions", dict(messages=[{"role": "tool", "content": "x"}]), "messages", "got 'tool'"),
    ("chat/completions", dict(messages=[{"role": "user"}]), "messages", "messages[0].content is missing"),
    ("chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
     "only text parts"),
    ("chat/completions", dict(messages=None), "messages", "invalid messages"),
    ("chat/completions", dict(max_completion_tokens=0), "max_completion_tokens", "must be a positive integer"),
])
def test_bad_requests_are_400_naming_the_field(served, path, changes, param, message):
    base = dict(model=served.model, max_tokens=4, temperature=0,
                **({"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT}))
    body = {k: v for k, v in {**base, **changes}.items() if v is not None}
    response = httpx.post(f"{served.base}/v1/{path}", json=body, headers=served.headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"], error
    assert served.client.completions.create(model=served.model, prompt=IDS, max_tokens=2).usage.completion_tokens == 2


def test_malformed_bodies_are_400(served):
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(f"{served.base}/v1/completions", content=content, headers=served.headers)
        assert response.status_code == 400 and response.json()["error"]["message"], content


def test_openai_client_sees_the_errors(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=served.model, prompt=PROMPT, n=2)
    assert error_of(info.value)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=served.model, messages=CHAT, temperature=-0.5)
    assert error_of(info.value)["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        served.client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT)
    assert error_of(info.value)["code"] == "model_not_found" and error_of(info.value)["param"] == "model"
    wrong = openai.OpenAI(base_url=f"{served.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=served.model, prompt=PROMPT)
    assert error_of(info.value)["code"] == "invalid_api_key"
    wrong.close()


def test_auth_covers_everything_but_health(served):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/metrics")):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            response = httpx.request(method, f"{served.base}{path}", json={}, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.base}/health").status_code == 200
    unknown = httpx.get(f"{served.base}/v2/nothing", headers=served.headers)
    assert unknown.status_code == 404 and "Not Found" in unknown.json()["error"]["message"]


# --- metrics -----------------------------------------------------------------------------------


def scrape(served) -> dict:
    """(name, frozenset(labels)) -> value of every sample."""
    text = httpx.get(f"{served.base}/metrics", headers=served.headers).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_scrape_parses_and_moves(served):
    before = scrape(served)
    got = served.client.completions.create(model=served.model, prompt=IDS, max_tokens=12, temperature=0)
    assert wait_until(lambda: scrape(served)[("specdec_requests_total", frozenset({("finish_reason", "length")}))]
                      == before[("specdec_requests_total", frozenset({("finish_reason", "length")}))] + 1)
    after = scrape(served)

    def moved(name, **labels):
        key = (name, frozenset(labels.items()))
        return after[key] - before[key]

    assert moved("specdec_generated_tokens_total") == got.usage.completion_tokens == 12
    assert moved("specdec_prompt_tokens_total") == len(IDS)
    assert moved("specdec_rounds_total") >= 1
    assert moved("specdec_time_to_first_token_seconds_count") == 1
    assert moved("specdec_request_duration_seconds_count") == 1
    assert moved("specdec_inter_token_latency_seconds_count") >= 1
    for phase in ("draft", "verify", "coordinator", "total"):
        assert moved("specdec_round_seconds_count", phase=phase) == moved("specdec_rounds_total")
    proposed = after[("specdec_draft_tokens_proposed_total", frozenset())]
    accepted = after[("specdec_draft_tokens_accepted_total", frozenset())]
    rate = after[("specdec_acceptance_rate", frozenset())]
    assert 0 <= accepted <= proposed and (rate == accepted / proposed if proposed else math.isnan(rate))
    assert after[("specdec_mean_accepted_length", frozenset())] >= 1.0
    replica = frozenset({("replica", "0")})
    assert after[("specdec_kv_blocks_total", replica)] == KV["kv_cache_blocks"]
    assert after[("specdec_kv_blocks_used", replica)] == 0  # released after the request
    assert after[("specdec_running_requests", replica)] == after[("specdec_queue_depth", replica)] == 0


def test_round_gauges_agree_with_the_requests_own_stats(reference):
    """Fed from RoundReports alone, the ratio gauges equal what the requests' stats say."""
    metrics = PrometheusMetrics()
    reference.on_round = metrics.on_round
    try:
        params = [SamplingParams(max_new_tokens=n, **sampling) for n, sampling in ((9, {}), (17, SAMPLED), (5, {}))]
        outs = reference.generate([PROMPT, IDS, IDS[:2]], params)
    finally:
        reference.on_round = None
    value = metrics.registry.get_sample_value
    proposed, accepted = sum(o.stats.proposed_tokens for o in outs), sum(o.stats.accepted_tokens for o in outs)
    assert value("specdec_generated_tokens_total") == sum(len(o.token_ids) for o in outs) == 31
    assert (value("specdec_draft_tokens_proposed_total"), value("specdec_draft_tokens_accepted_total")) == (
        proposed, accepted)
    assert proposed > 0 and value("specdec_acceptance_rate") == pytest.approx(accepted / proposed)
    passes = sum(o.stats.target_forward_passes for o in outs)
    assert value("specdec_mean_accepted_length") == pytest.approx(31 / passes)
    assert value("specdec_rounds_total") == max(o.stats.target_forward_passes for o in outs)  # batched together


# --- disconnects -------------------------------------------------------------------------------


CANCELLED = ("specdec_requests_total", frozenset({("finish_reason", "cancelled")}))
LENGTH = ("specdec_requests_total", frozenset({("finish_reason", "length")}))
GENERATED = ("specdec_generated_tokens_total", frozenset())
LONG = 100  # tokens: many rounds (K <= 4); the scheduler holds after one until the client has gone


def assert_cancelled_not_finished(served, before) -> None:
    """The request was aborted: counted as cancelled, and it never generated all its tokens."""
    assert wait_until(lambda: scrape(served)[CANCELLED] == before[CANCELLED] + 1)
    after = scrape(served)
    assert after[LENGTH] == before[LENGTH] and after[GENERATED] - before[GENERATED] < LONG


def test_client_disconnect_mid_stream_frees_kv_blocks(served):
    before = scrape(served)
    # The request cannot finish before the server has seen the client go: the scheduler holds
    # after the first round that streamed text (the first SSE event) until the abort was sent.
    gate = RoundGate(holds=lambda report: any(u.text and not u.finished for u in report.updates))
    served.scheduler.on_round = gate
    try:
        body = dict(model=served.model, prompt=IDS, max_tokens=LONG, temperature=0, stream=True)
        with Calls(served.scheduler, "abort") as aborts:
            with httpx.Client(headers=served.headers) as client:
                with client.stream("POST", f"{served.base}/v1/completions", json=body) as response:
                    first = next(response.iter_lines())
                    assert first.startswith("data: ") and kv_used(served.factory) > 0
            [req_id] = gate.held_request_ids()
            assert aborts.wait_first_arg(req_id)
        gate.open()
        assert wait_until(lambda: kv_used(served.factory) == 0)
        assert not served.scheduler.scheduler.running and served.scheduler.num_active == 0
    finally:
        gate.open()
        served.scheduler.on_round = None
    assert_cancelled_not_finished(served, before)
    assert served.client.completions.create(model=served.model, prompt=IDS, max_tokens=3).usage.completion_tokens == 3


def test_client_disconnect_while_waiting_for_a_whole_response_frees_kv_blocks(served):
    before = scrape(served)
    # The request cannot finish before the client has timed out and gone: the scheduler holds
    # after its first round until the abort was sent.
    gate = RoundGate()
    served.scheduler.on_round = gate
    try:
        body = dict(model=served.model, prompt=IDS, max_tokens=LONG, temperature=0)
        with Calls(served.scheduler, "abort") as aborts:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{served.base}/v1/completions", json=body, headers=served.headers, timeout=0.3)
            [req_id] = gate.held_request_ids()
            assert aborts.wait_first_arg(req_id)
        gate.open()
        assert wait_until(lambda: kv_used(served.factory) == 0 and not served.scheduler.scheduler.running)
        assert served.scheduler.num_active == 0
    finally:
        gate.open()
        served.scheduler.on_round = None
    assert_cancelled_not_finished(served, before)
