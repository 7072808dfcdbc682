"""The OpenAI-compatible HTTP API on servers of their own (tests/http_pair.py's models): 503 until
the engine is ready and while draining (in-flight streams still finish), chat on a model without
a chat template, the API turned off, and HTTPS with the server's certificate.
"""
from __future__ import annotations

import ssl
import threading
from dataclasses import replace

import grpc
import httpx
import pytest

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from specdec.client import GenerationClient
from specdec.tokenizer import load_tokenizer
from specdec_app.embedded import LocalSchedulerFactory

from gates import RoundGate, wait_until
from http_pair import CHAT, IDS, PROMPT, http_config, http_pair
from served_pair import kv_used, loading_factory, self_signed_cert


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return http_pair(tmp_path_factory)


# --- servers of their own ----------------------------------------------------------------------


def test_503_until_ready(models):
    factory = LocalSchedulerFactory(http_config(models))
    gate, slow_factory = loading_factory(factory)
    with run_server_in_thread(slow_factory, factory.tokenizer, wait_ready=False) as handle:
        base = f"http://127.0.0.1:{handle.http_port}"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        refused = httpx.post(f"{base}/v1/completions", json=dict(model=models.target, prompt=PROMPT))
        assert refused.status_code == 503 and "still loading" in refused.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models").status_code == 503
        gate.set()
        assert wait_until(lambda: httpx.get(f"{base}/health").status_code == 200)
        ok = httpx.post(f"{base}/v1/completions", json=dict(model=models.target, prompt=PROMPT, max_tokens=2))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_503_while_draining_and_in_flight_streams_finish(models):
    factory = LocalSchedulerFactory(http_config(models))
    with run_server_in_thread(factory, factory.tokenizer) as handle:
        base = f"http://127.0.0.1:{handle.http_port}"
        # The stream is still in flight while the drain is checked: the scheduler holds after the
        # round that streamed its first event until then.
        gate = RoundGate(holds=lambda report: any(u.text and not u.finished for u in report.updates))
        handle.server.scheduler.on_round = gate
        body = dict(model=models.target, prompt=IDS, max_tokens=30, temperature=0, stream=True)
        with httpx.Client() as client, client.stream("POST", f"{base}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            stopper = threading.Thread(target=handle.stop, args=(60.0,))
            try:
                stopper.start()
                assert wait_until(lambda: handle.server.gate.draining)
                health = httpx.get(f"{base}/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                refused = httpx.post(f"{base}/v1/completions", json=dict(model=models.target, prompt=PROMPT))
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            finally:
                gate.open()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        stopper.join(60)
        assert not stopper.is_alive() and kv_used(factory) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health")


def test_chat_on_a_model_without_a_chat_template(models):
    factory = LocalSchedulerFactory(http_config(models, target=models.plain, draft="ngram"))
    with run_server_in_thread(factory, factory.tokenizer) as handle:
        assert load_tokenizer(models.plain).chat_template is None
        response = httpx.post(f"http://127.0.0.1:{handle.http_port}/v1/chat/completions",
                              json=dict(model=models.plain, messages=CHAT))
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert response.json()["error"]["message"] == "this model has no chat template; send a prompt instead"
        with GenerationClient(f"127.0.0.1:{handle.port}") as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate(messages=CHAT)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "this model has no chat template; send a prompt instead"
            assert client.generate(PROMPT, max_new_tokens=2).finish_reason == "length"


def test_http_port_zero_turns_the_api_off(models):
    factory = LocalSchedulerFactory(http_config(models, draft=None))
    with run_server_in_thread(factory, factory.tokenizer, replace(LOOPBACK_SERVER, http_port=0)) as handle:
        assert handle.http_port is None
        with GenerationClient(f"127.0.0.1:{handle.port}") as client:
            assert client.generate(IDS, max_new_tokens=2).finish_reason == "length"


def test_https_with_the_servers_certificate(models, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    factory = LocalSchedulerFactory(http_config(models, draft=None))
    tls = replace(LOOPBACK_SERVER, tls_cert=str(cert), tls_key=str(key))
    with run_server_in_thread(factory, factory.tokenizer, tls) as handle:
        trusted = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"https://127.0.0.1:{handle.http_port}/health", verify=trusted).json() == {"status": "ok"}
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://127.0.0.1:{handle.http_port}/health")
