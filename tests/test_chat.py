"""Chat: a conversation rendered with the model's own chat template (specdec.tokenizer.render_chat,
the one rendering LocalEngine, gRPC and HTTP share), LocalEngine.chat, the gRPC `messages`
field, and `specdec generate --chat`."""
from __future__ import annotations

import argparse
import io
from contextlib import redirect_stderr, redirect_stdout

import grpc
import pytest
from transformers import AutoTokenizer

from specdec.params import SamplingParams
from specdec.tokenizer import render_chat
from specdec_app import generate as generate_command

from served_pair import SAMPLED, build_pair, local_reference, serving

CHAT = [{"role": "system", "content": "speculative decoding drafts tokens"},
        {"role": "user", "content": "hello server, the quick brown fox"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_pair(tmp_path_factory, "chat", chat_template=True)


@pytest.fixture(scope="module")
def reference(models):
    return local_reference(models)


@pytest.fixture(scope="module")
def served(models):
    with serving(models) as handle:
        yield handle


# --- the rendering ---------------------------------------------------------------------------


def test_render_chat_is_the_models_template_with_the_assistant_turn_open(models):
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == ("system: speculative decoding drafts tokens\nuser: hello server, the quick brown fox\n"
                    "assistant:")
    assert render_chat(tokenizer, CHAT) == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("messages,message", [
    ([], "messages is empty"),
    ([{"role": "tool", "content": "x"}], "messages[0].role must be one of system, user, assistant, got 'tool'"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
    ("hello", "messages must be a list"),
    (["hello"], "messages[0] must be a {role, content} object"),
])
def test_render_chat_rejects_malformed_conversations(models, messages, message):
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    with pytest.raises(ValueError) as info:
        render_chat(tokenizer, messages)
    assert message in str(info.value)


def test_render_chat_without_a_template_or_with_a_refusing_one(models):
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    for no_template in (None, _without_template(tokenizer)):
        with pytest.raises(ValueError, match="this model has no chat template; send a prompt instead"):
            render_chat(no_template, CHAT)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template rejected the messages: roles must alternate"):
        render_chat(tokenizer, CHAT)


def _without_template(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    return tokenizer


# --- LocalEngine -----------------------------------------------------------------------------


def test_local_engine_chat_is_generate_on_the_rendered_prompt(reference):
    params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16, seed=3, **SAMPLED)]
    chats = reference.chat([CHAT, CHAT[1:]], params)
    plain = reference.generate([render_chat(reference.tokenizer, CHAT), render_chat(reference.tokenizer, CHAT[1:])],
                               params)
    for got, want in zip(chats, plain):
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "length"
    assert chats[0].text  # the tokenizer path produced text
    with pytest.raises(TypeError, match="list of conversations"):
        reference.chat(CHAT)  # one conversation, not a list of them
    with pytest.raises(ValueError, match="role"):
        reference.chat([[{"role": "robot", "content": "x"}]])


# --- gRPC ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, dict(SAMPLED, seed=11)], ids=["greedy", "seeded"])
def test_grpc_chat_equals_local_engine(served, reference, sampling):
    want = reference.chat([CHAT], SamplingParams(max_new_tokens=20, **sampling))[0]
    responses = list(served.client.generate_stream(messages=CHAT, max_new_tokens=20, **sampling))
    assert [t for r in responses for t in r.token_ids] == want.token_ids
    assert "".join(r.text for r in responses) == want.text
    last = responses[-1]
    assert last.finish_reason == want.finish_reason == "length"
    assert last.stats.prompt_tokens == len(render_chat(reference.tokenizer, CHAT))


@pytest.mark.parametrize("options,message", [
    (dict(prompt="hi"), "give either messages or a prompt (prompt / prompt_token_ids), not both"),
    (dict(prompt=[1, 2]), "give either messages or a prompt (prompt / prompt_token_ids), not both"),
    (dict(messages=[{"role": "narrator", "content": "x"}]), "got 'narrator'"),
])
def test_grpc_chat_bad_input_is_invalid_argument(served, options, message):
    options = {"messages": CHAT, **options}
    prompt = options.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as info:
        served.client.generate(prompt, max_new_tokens=4, **options)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert served.client.generate(messages=CHAT, max_new_tokens=2).finish_reason == "length"


def test_cli_generate_chat(served, reference):
    system, user = CHAT[0]["content"], CHAT[1]["content"]
    want = reference.chat([CHAT], SamplingParams(max_new_tokens=12))[0]
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    address = f"127.0.0.1:{served.handle.port}"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert generate_command.run(parser.parse_args(["--chat", user, "--system", system, "--address", address,
                                                       "--max-new-tokens", "12"])) == 0
    assert out.getvalue() == want.text + "\n"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert generate_command.run(parser.parse_args(["--system", system, "x", "--address", address])) == 2
        assert generate_command.run(parser.parse_args(["--chat", user, "x", "--address", address])) == 2
    assert err.getvalue().splitlines() == ["error: --system needs --chat",
                                           "error: give either --chat or a prompt / --token-ids, not both"]
