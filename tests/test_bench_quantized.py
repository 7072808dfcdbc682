"""`specdec bench-quant` and `specdec bench-peer` run end to end on small models and say what they
measured (llama.cpp's rows only where llama-cpp-python is installed, which CI does not do)."""
import json

import pytest

from specdec.model.cpu_kernels import load_cpu_kernels
from specdec_app import cli
from specdec_app.bench import peer_command

from checkpoints import build_checkpoint

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler on this machine")


@needs_kernels
def test_bench_quant_reports_agreement_with_the_floats(tmp_path, capsys):
    target = build_checkpoint(tmp_path / "target", seed=2, vocab_size=320, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": ids}) for ids in ([3, 17, 42, 7], [8, 9, 10, 11, 12])))
    out = tmp_path / "quant.json"
    assert cli.main(["bench-quant", "--target", str(target), "--prompts", str(prompts), "--num-prompts", "2",
                     "--max-new-tokens", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"q8", "q4"}
    for row in rows.values():
        assert 0 <= row["greedy_match"] <= 1 and row["mean_kl"] >= 0 and row["positions"] == 12
    assert rows["q4"]["weight_bytes"] < rows["q8"]["weight_bytes"]
    assert "top-1 match" in capsys.readouterr().out
    # the float weights with a float16 KV cache: the cache's own distance from the float model
    assert cli.main(["bench-quant", "--target", str(target), "--prompts", str(prompts), "--num-prompts", "2",
                     "--max-new-tokens", "6", "--formats", "fp", "--kv-cache-dtype", "float16", "--json",
                     str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "float16" and abs(result["rows"]["fp"]["mean_kl"]) < 1e-3
    assert "KV cache float16" in capsys.readouterr().out


@needs_kernels
def test_bench_peer_measures_specdec_without_llama_cpp(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(peer_command, "llama_cpp_version", lambda: None)
    out = tmp_path / "peer.json"
    assert cli.main(["bench-peer", "--quick", "--types", "Q8_0", "--cache-dir", str(tmp_path),
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["rows"]["Q8_0"]
    assert {"specdec b1", "specdec b8", "specdec n-gram", "specdec plain"} == set(row["rates"])
    assert row["ngram_same_as_plain"] and row["llama_cpp"] is None
    assert result["kv_cache_dtype"] == "float16"  # llama.cpp's default cache, unless --kv-cache-dtype
    printed = capsys.readouterr().out
    assert "not installed (pip install llama-cpp-python)" in printed and "weights held" in printed
    assert "specdec's KV cache float16" in printed
    assert (tmp_path / "tiny-copy-v1-seed0-Q8_0.gguf").exists()  # built once, then reused


@needs_kernels
def test_bench_peer_skips_a_llama_cpp_that_dies_on_this_cpu(tmp_path, capsys, monkeypatch):
    # a llama.cpp whose kernels die of SIGILL (as its AMX build did in a VM offering AMX): its
    # rows are skipped with the reason, specdec's are still measured
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, signal\n\nclass Llama:\n    def __init__(self, **_):\n"
                                      "        os.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setattr(peer_command, "llama_cpp_version", lambda: "0.0-fake")
    out = tmp_path / "peer.json"
    assert cli.main(["bench-peer", "--quick", "--types", "Q8_0", "--cache-dir", str(tmp_path),
                     "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["Q8_0"]
    assert row["llama_cpp_failure"] == "it died of SIGILL decoding 3 tokens"
    assert set(row["rates"]) == {"specdec b1", "specdec b8", "specdec n-gram", "specdec plain"}
    assert "llama.cpp not measured: it died of SIGILL" in capsys.readouterr().out


def test_bench_peer_refuses_bad_counts(capsys):
    assert cli.main(["bench-peer", "--runs", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


@needs_kernels
def test_bench_step_measures_a_quantized_gguf(tmp_path, capsys, monkeypatch):
    """bench-step takes a GGUF held as codes: no torch path to compare its kernels with, and says so."""
    monkeypatch.setattr(peer_command, "llama_cpp_version", lambda: None)
    assert cli.main(["bench-peer", "--quick", "--types", "Q4_1", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    gguf = tmp_path / "tiny-copy-v1-seed0-Q4_1.gguf"
    assert cli.main(["bench-step", "--quick", "--target", str(gguf)]) == 0
    printed = capsys.readouterr().out
    assert "weights as codes" in printed and "no torch path to compare with" in printed
    assert "same output as plain: True" in printed
