"""The generated GGUF: well-formed metadata, deterministic, any text tokenizes in llama.cpp."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefix_sidecar_tools.realengine.gguf_model import (
    WORDS,
    ModelShape,
    build_vocab,
    main,
    write_model,
)
from prefix_sidecar_tools.realengine.pods import llama_cpp_available

gguf = pytest.importorskip("gguf", reason="the gguf package writes the model")


def test_vocab_has_specials_bytes_and_words() -> None:
    tokens, types, scores = build_vocab(1024)
    assert len(tokens) == len(types) == len(scores) == 1024
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert set(types[3:259]) == {gguf.TokenType.BYTE}
    assert all("\u2581" + w in tokens for w in WORDS), "every workload word is one piece"
    assert len(set(tokens)) == len(tokens)


def test_model_file_is_deterministic_and_complete(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf")
    b = write_model(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    reader = gguf.GGUFReader(str(a))
    for key in (
        "llama.context_length",
        "llama.embedding_length",
        "llama.block_count",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ):
        assert key in reader.fields, key
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
    assert "blk.1.ffn_down.weight" in names and "blk.2.attn_q.weight" not in names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vocab", "100"], "too small"),
        (["--embd", "65"], "multiple of --heads"),
        (["--vocab", "100000"], "too large"),
    ],
)
def test_cli_rejects_bad_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main([str(tmp_path / "m.gguf"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.real_engine
@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python not installed")
def test_llama_cpp_tokenizes_any_text(tmp_path: Path) -> None:
    from llama_cpp import Llama

    path = write_model(tmp_path / "m.gguf", ModelShape(seed=7))
    llm = Llama(str(path), vocab_only=True, verbose=False)
    text = "the discount applies: 499 yuan, Wörld 🙂 <s> end"
    tokens = llm.tokenize(text.encode(), add_bos=False)
    # SentencePiece adds a word-start mark before the first word, hence the leading space;
    # "<s>" stays text (no special parsing) and the emoji goes through byte tokens
    assert llm.detokenize(tokens).decode() == " " + text
    assert 1 not in tokens and set(range(3, 259)) & set(tokens)
    words = llm.tokenize(" ".join(WORDS).encode(), add_bos=False)
    assert len(words) == len(WORDS), "each workload word is exactly one token"
