"""Incremental detokenisation: text equals the full decode, stop strings cut exactly, partial
stop strings and half UTF-8 characters are held back until resolved; the text is decoded a tail
at a time only where that gives the full decode's text."""
from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from coordinator.rounds.tail_decoder import TailDecoder, decodes_in_pieces
from coordinator.rounds.text_stream import TextStream, held_back_suffix

CORPUS = [
    "hello world, hello there. STOP here",
    "the end is near END of the line",
    "hello hello hello world world",
    "speculative decoding drafts tokens and the target verifies them",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained offline: ASCII words merge, other characters stay bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def enc(tokenizer, *pieces: str) -> list[int]:
    """Token ids with a token boundary at least between consecutive pieces."""
    return [i for p in pieces for i in tokenizer(p, add_special_tokens=False)["input_ids"]]


def stream_all(stream: TextStream, ids: list[int], chunk_sizes=None):
    """Feed ids in chunks; return (released chunks, kept ids, stop hit)."""
    chunks, kept, hit = [], [], False
    pos = 0
    sizes = iter(chunk_sizes or [])
    while pos < len(ids) and not hit:
        n = next(sizes, 1)
        k, text, hit = stream.add(ids[pos:pos + n])
        pos += n
        kept += k
        chunks.append(text)
    return chunks, kept, hit


# ---------------------------------------------------------------- held_back_suffix

@pytest.mark.parametrize("text, stops, expected", [
    ("", ("STOP",), 0),
    ("hello", (), 0),
    ("hello", ("STOP",), 0),
    ("hello S", ("STOP",), 1),
    ("hello ST", ("STOP",), 2),
    ("hello STO", ("STOP",), 3),
    ("hello STOP", ("STOP",), 0),  # a complete stop string is not a *proper* prefix: add() cuts it
    ("xS", ("STOP", "SAFE"), 1),
    ("xSA", ("STOP", "SAFE"), 2),
    ("ab", ("b", "abc"), 2),  # the longest candidate over all stops
    ("aa", ("aab",), 2),
    ("aaa", ("aab",), 2),
    ("x", ("x",), 0),  # one-character stops are never held
    ("EN", ("END", "\n\n"), 2),
    ("a\n", ("END", "\n\n"), 1),
    ("日本", ("本語",), 1),
])
def test_held_back_suffix(text, stops, expected):
    assert held_back_suffix(text, stops) == expected


def test_held_back_suffix_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 8)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(0, 3)))
        expected = max([n for s in stops for n in range(0, len(s)) if n <= len(text) and text.endswith(s[:n])],
                       default=0)
        assert held_back_suffix(text, stops) == expected, (text, stops)


# ---------------------------------------------------------------- incremental == full decode

TEXTS = [
    "hello world, hello there.",
    "the end is near END of the line",
    "naïve café – 日本語 🙂 ok",
    "🙂🙂 mixed: ä ö ü ß € 𝄞 end",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_incremental_text_equals_full_decode(tokenizer, text, chunking):
    ids = enc(tokenizer, text)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text
    rng = random.Random(len(text))
    sizes = [1] * len(ids) if chunking == "one" else [rng.randrange(1, 5) for _ in ids]
    stream = TextStream(tokenizer)
    chunks, kept, hit = stream_all(stream, ids, sizes)
    assert not hit and kept == ids
    for c in chunks:
        assert "\ufffd" not in c, "half a UTF-8 character was released"
    assert "".join(chunks) + stream.finish() == full
    assert stream.finish() == ""  # nothing left twice
    assert stream.text == full


def test_multibyte_character_is_released_only_when_complete(tokenizer):
    ids = enc(tokenizer, "日")
    assert len(ids) == 3, "the test tokenizer keeps CJK characters as separate bytes"
    stream = TextStream(tokenizer)
    assert stream.add(ids[:1]) == (ids[:1], "", False)
    assert stream.add(ids[1:2]) == (ids[1:2], "", False)
    assert stream.add(ids[2:]) == (ids[2:], "日", False)
    emoji = enc(tokenizer, "🙂")
    assert len(emoji) >= 2
    out = [stream.add([t])[1] for t in emoji]
    assert out[:-1] == [""] * (len(emoji) - 1) and out[-1] == "🙂"


def test_finish_releases_a_dangling_partial_character(tokenizer):
    ids = enc(tokenizer, "ok 日")[:-1]  # the last byte never comes
    stream = TextStream(tokenizer)
    _, text, _ = stream.add(ids)
    assert text == "ok "
    assert stream.finish() == "\ufffd"  # the final flush hands over whatever decode gives


def test_no_tokenizer_passes_tokens_through():
    stream = TextStream(None, ("STOP",))
    assert stream.add([1, 2, 3]) == ([1, 2, 3], "", False)
    assert stream.add([]) == ([], "", False)
    assert stream.finish() == ""
    assert stream.token_ids == [1, 2, 3]


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    stream = TextStream(tokenizer)
    ids = enc(tokenizer, "hello") + [eos]
    _, text, _ = stream.add(ids)
    assert text + stream.finish() == "hello"


# ---------------------------------------------------------------- stop strings

def test_stop_string_cuts_text_and_drops_later_tokens(tokenizer):
    ids = enc(tokenizer, "hello", " world", " STOP", " after", " more")
    completing = len(enc(tokenizer, "hello", " world", " STOP"))
    stream = TextStream(tokenizer, ("STOP",))
    chunks, kept, hit = stream_all(stream, ids, [len(ids)])  # all in one round
    assert hit
    assert kept == ids[:completing]
    assert "".join(chunks) == "hello world "


def test_stop_string_completed_inside_a_token(tokenizer):
    # "ell" lies inside the single token "hello": the text stops before it, the token is kept
    assert len(enc(tokenizer, "hello")) == 1
    ids = enc(tokenizer, "a ", "hello", " world")
    stream = TextStream(tokenizer, ("ell",))
    chunks, kept, hit = stream_all(stream, ids)
    assert hit and kept == enc(tokenizer, "a ", "hello")
    assert "".join(chunks) == "a h"


def test_stop_string_spanning_several_tokens_fed_one_by_one(tokenizer):
    ids = enc(tokenizer, "hello", " ", "w", "o", "r", "l", "d", " tail")
    stream = TextStream(tokenizer, ("lo wor",))
    released = []
    for t in ids:
        kept, text, hit = stream.add([t])
        released.append(text)
        if hit:
            break
    assert hit and len(released) == 5  # the "r" token (index 4) completes the stop string
    assert "".join(released) == "hel"
    # while the match was only partial, nothing of it was released
    assert released[1:4] == ["", "", ""]


def test_partial_stop_string_is_held_until_resolved(tokenizer):
    stream = TextStream(tokenizer, ("END",))
    assert stream.add(enc(tokenizer, "near "))[1] == "near "
    assert stream.add(enc(tokenizer, "E"))[1] == ""
    assert stream.add(enc(tokenizer, "N"))[1] == ""
    # "ENx" cannot become "END" any more: all of it is released at once
    assert stream.add(enc(tokenizer, "x"))[1] == "ENx"
    assert stream.add(enc(tokenizer, " E"))[1] == " "
    # the stream ends while "E" is still pending: finish() hands it over
    assert stream.finish() == "E"


def test_held_back_text_is_cut_when_the_stop_completes(tokenizer):
    stream = TextStream(tokenizer, ("END",))
    assert stream.add(enc(tokenizer, "the ", "E", "N"))[1] == "the "
    kept, text, hit = stream.add(enc(tokenizer, "D", " rest"))
    assert hit and kept == enc(tokenizer, "D") and text == ""


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = enc(tokenizer, "a", "b", "c", "d", "e")
    stream = TextStream(tokenizer, ("cde", "d"))
    chunks, kept, hit = stream_all(stream, ids, [5])
    # "d" completes first (at the "d" token); "cde" would start earlier but is not complete yet
    assert hit and kept == enc(tokenizer, "a", "b", "c", "d")
    assert "".join(chunks) == "abc"
    stream = TextStream(tokenizer, ("bcd", "cd"))
    chunks, kept, hit = stream_all(stream, ids, [5])
    # both complete at the "d" token: the text is cut at the earlier start
    assert hit and kept == enc(tokenizer, "a", "b", "c", "d") and "".join(chunks) == "a"


def test_stop_string_at_the_very_start(tokenizer):
    stream = TextStream(tokenizer, ("hello",))
    kept, text, hit = stream.add(enc(tokenizer, "hello", " world"))
    assert hit and kept == enc(tokenizer, "hello") and text == ""


def test_stop_string_with_multibyte_characters(tokenizer):
    ids = enc(tokenizer, "ok ", "日本", "語", " 🙂")
    stream = TextStream(tokenizer, ("本語",))
    chunks, kept, hit = stream_all(stream, ids)
    assert hit and kept == enc(tokenizer, "ok ", "日本", "語")
    assert "".join(chunks) == "ok 日"


def test_random_streams_against_a_reference(tokenizer):
    """Any chunking: released text == full decode cut at the first stop string; kept tokens are
    the shortest prefix whose decode contains a stop string."""
    rng = random.Random(7)
    pieces = ["a", "b", "ab", " ", "é", "日", "🙂", "x", "END", "E", "N", "D"]
    stop_pool = ["ab ", "日x", "🙂", "END", "b é", "xx"]
    for trial in range(120):
        ids = enc(tokenizer, *[rng.choice(pieces) for _ in range(rng.randrange(1, 14))])
        stops = tuple(rng.sample(stop_pool, rng.randrange(0, 3)))
        sizes = [rng.randrange(1, 4) for _ in ids]
        stream = TextStream(tokenizer, stops)
        chunks, kept, hit = stream_all(stream, ids, sizes)
        decode = lambda xs: tokenizer.decode(xs, skip_special_tokens=True)  # noqa: E731
        n_stop = next((n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stops)), None)
        if n_stop is None:
            assert not hit and kept == ids
            for c in chunks:
                assert "\ufffd" not in c
            assert "".join(chunks) + stream.finish() == decode(ids), (trial, ids, stops)
        else:
            text = decode(ids[:n_stop])
            cut = min(text.find(s) for s in stops if s in text)
            assert hit and kept == ids[:n_stop], (trial, stops)
            assert "".join(chunks) == text[:cut], (trial, stops)


# ---------------------------------------------------------------- a tail at a time

SHIPPED_TOKENIZER = "models/target"


@pytest.fixture(params=["test BPE", "shipped"])
def byte_level(request, tokenizer):
    if request.param == "test BPE":
        return tokenizer
    return transformers.AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)


def id_pool(tok) -> list[int]:
    """Whole words, lone bytes of multi-byte characters, special tokens and any id at all."""
    rng = random.Random(5)
    pool = enc(tok, *"the 日本語 🙂 é 𝄞 ok\n".split(" "))
    pool += [i for i in enc(tok, "日🙂𝄞€") for _ in range(4)]
    pool += list(tok.all_special_ids) * 4
    pool += [rng.randrange(len(tok)) for _ in range(40)]
    return pool


def test_tail_decode_equals_the_whole_decode_at_every_step(byte_level):
    assert decodes_in_pieces(byte_level)
    pool = id_pool(byte_level)
    rng = random.Random(11)
    for trial in range(60):
        decoder, ids = TailDecoder(byte_level), []
        for _ in range(rng.randrange(1, 12)):
            ids += [rng.choice(pool) for _ in range(rng.randrange(1, 6))]
            assert decoder.text(ids) == byte_level.decode(ids, skip_special_tokens=True), (trial, ids)


class CountingTokenizer:
    """Counts the token ids it decodes; everything else is the wrapped tokenizer's."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_long_response_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """Decoding everything each round read n^2 / 2 tokens over a response of n: 2 million here."""
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, ("never said",))
    words = enc(tokenizer, "hello", " world", " 日", " the", " end")
    ids = [words[i % len(words)] for i in range(2000)]
    released = "".join(stream.add([t])[1] for t in ids) + stream.finish()
    assert released == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 4 * len(ids)


class CleaningTokenizer(PreTrainedTokenizerFast):
    """Post-processes the joined text, as clean_up_tokenization_spaces does: " ." becomes "."."""

    def decode(self, ids, **kwargs):
        return super().decode(ids, **kwargs).replace(" .", ".")


def sentencepiece_like_tokenizer():
    """Metaspace decoding: the whole text's first space is dropped, so pieces do not add up."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁.": 3, "x": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["sentencepiece-like", "cleaning"])
def test_decoders_that_join_across_tokens_are_decoded_whole(tokenizer, kind):
    if kind == "cleaning":
        tok = CleaningTokenizer(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>")
        ids = enc(tok, "hello", " .", " world", " .")
    else:
        tok = sentencepiece_like_tokenizer()
        ids = [1, 2, 3, 1, 4]
    assert not decodes_in_pieces(tok)
    decoder = TailDecoder(tok)
    for n in range(1, len(ids) + 1):
        assert decoder.text(ids[:n]) == tok.decode(ids[:n], skip_special_tokens=True)
    # the pieces alone would not give it: that is why it is decoded whole
    whole = tok.decode(ids, skip_special_tokens=True)
    assert "".join(tok.decode([t], skip_special_tokens=True) for t in ids) != whole


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tokenizer, tmp_path_factory):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, initializer_range=0.2)
    path = tmp_path_factory.mktemp("ts_ckpt")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(raw))
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("draft", [None, "self"])
def test_engine_stop_string(checkpoint_with_tokenizer, draft):
    from specdec import LocalEngine, SamplingParams

    path = checkpoint_with_tokenizer
    engine = LocalEngine(path, draft=path if draft == "self" else None, num_speculative_tokens=5)
    assert engine.tokenizer is not None
    prompt = "hello world"
    [full] = engine.generate([prompt], SamplingParams(max_new_tokens=40))
    assert full.finish_reason == "length"
    decode = lambda xs: engine.tokenizer.decode(xs, skip_special_tokens=True)  # noqa: E731
    assert full.text == decode(full.token_ids)
    # a stop string taken from the middle of what the model generates (ASCII, no half characters)
    text = full.text
    start = next(i for i in range(len(text) // 3, len(text) - 2)
                 if text[i:i + 2].isascii() and text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    n_stop = next(n for n in range(1, len(full.token_ids) + 1) if stop in decode(full.token_ids[:n]))
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:n_stop]
    assert out.text == text[:text.find(stop)]
    assert engine.target_worker.cache.allocator.num_used == 0
