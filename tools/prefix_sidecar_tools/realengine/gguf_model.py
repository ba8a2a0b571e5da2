"""Write a tiny random-weight llama-architecture GGUF that llama.cpp can serve.

Why: the real-engine tests need an engine that really keeps a KV cache of a prompt
prefix, but nothing may be downloaded at run time. A 2-layer, 64-dim llama with random
weights is cheap enough for a test, yet the prefill of a long prompt is still much slower
than a cache hit (docs/benchmarks.md has the figures), which is the effect the sidecar
exploits. The text it generates is noise; that does not matter here.

The vocabulary is SentencePiece style ("llama" tokenizer model): <unk>, <s>, </s>, the
256 byte-fallback tokens <0x00>..<0xFF> (so any text tokenizes), single characters, and
"▁word" pieces with every intermediate prefix present so the SPM bigram merge can reach
the whole word.

    python -m prefix_sidecar_tools.realengine.gguf_model OUT.gguf \
        [--layers 2 --embd 64 --vocab 1024]
"""

from __future__ import annotations

import argparse
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# SentencePiece marks a word start (a preceding space) with U+2581.
SPACE_MARK = "\u2581"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
N_BYTE_TOKENS = 256

# Words from the mission's domain (promotion compliance rules); the synthetic prompt
# text in workload.py is drawn from the same list, so prompts tokenize into whole words.
_WORD_TEXT = (
    "the and of to in for on with is are be by this that from or as at not each all any "
    "per rule rules store price discount coupon order merchant category commission rate "
    "product promotion sale live stream script banned word words law advertising must may "
    "shall cross total item items buyer seller refund days yuan percent off limit stack "
    "priority platform compliance check section clause table listed above below no more "
    "than less free shipping gift event period before after during only when if then "
    "apply applies applied"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters; defaults are the smallest model that still behaves like llama."""

    layers: int = 2
    embd: int = 64
    heads: int = 4
    kv_heads: int = 4
    ff: int = 192
    vocab: int = 1024
    context: int = 4096
    seed: int = 1234

    def validate(self) -> None:
        if self.embd % self.heads:
            raise ValueError(f"--embd {self.embd} must be a multiple of --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads")
        if (self.embd // self.heads) % 2:
            raise ValueError("head size (embd/heads) must be even for RoPE")
        minimum = len(SPECIAL_TOKENS) + N_BYTE_TOKENS + len(_base_pieces())
        if self.vocab < minimum:
            raise ValueError(f"--vocab {self.vocab} is too small: need at least {minimum}")
        if self.layers < 1 or self.ff < 1 or self.context < 16:
            raise ValueError("--layers, --ff must be >= 1 and --context >= 16")


def _base_pieces() -> list[str]:
    """Single characters: the word-start mark, letters, digits, punctuation."""
    chars = SPACE_MARK + string.ascii_letters + string.digits + string.punctuation
    return list(dict.fromkeys(chars))


def build_vocab(size: int) -> tuple[list[str], list[int], list[float]]:
    """Return (tokens, token_types, scores) with exactly `size` entries.

    Order: specials, bytes, single characters, word prefixes, then letter bigrams as
    filler. Normal pieces score -rank like a trained SentencePiece model.
    """
    from gguf import TokenType

    tokens = list(SPECIAL_TOKENS)
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    tokens += [f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)]
    types += [int(TokenType.BYTE)] * N_BYTE_TOKENS
    normal: list[str] = _base_pieces()
    seen = set(normal)
    candidates = [SPACE_MARK + w[:i] for w in WORDS for i in range(1, len(w) + 1)]
    candidates += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    for piece in candidates:
        if len(tokens) + len(normal) >= size:
            break
        if piece not in seen:
            seen.add(piece)
            normal.append(piece)
    if len(tokens) + len(normal) < size:
        raise ValueError(f"--vocab {size} is too large: at most {len(tokens) + len(seen)}")
    scores = [0.0] * len(tokens) + [-float(rank) for rank in range(len(normal))]
    tokens += normal
    types += [int(TokenType.NORMAL)] * len(normal)
    return tokens, types, scores


def write_model(path: str | Path, shape: ModelShape | None = None) -> Path:
    """Write the GGUF to `path` (parents created) and return the path."""
    import gguf

    shape = shape or ModelShape()
    shape.validate()
    tokens, types, scores = build_vocab(shape.vocab)  # may raise: before any file exists
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.embd // shape.heads

    def weight(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is ggml ne = [cols, rows]: the writer reverses the shape.
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return np.ones(shape.embd, dtype=np.float32)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("prefix-sidecar tiny random llama")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    writer.add_tensor("token_embd.weight", weight(shape.vocab, shape.embd))
    kv_dim = shape.kv_heads * head_dim
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(shape.embd, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv_dim, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv_dim, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(shape.embd, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.ff, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.ff, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(shape.embd, shape.ff))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", weight(shape.vocab, shape.embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    defaults = ModelShape()
    parser = argparse.ArgumentParser(
        prog="python -m prefix_sidecar_tools.realengine.gguf_model",
        description="Write a tiny deterministic random-weight llama GGUF for llama.cpp.",
    )
    parser.add_argument("out", type=Path, help="output .gguf path")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--embd", type=int, default=defaults.embd)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--ff", type=int, default=defaults.ff)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    shape = ModelShape(
        layers=args.layers,
        embd=args.embd,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        ff=args.ff,
        vocab=args.vocab,
        context=args.context,
        seed=args.seed,
    )
    try:
        path = write_model(args.out, shape)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
