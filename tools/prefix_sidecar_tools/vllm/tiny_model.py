"""Build a tiny random-weight Llama with its own BPE tokenizer, offline, for real vLLM pods.

Why: the vLLM tests and the fleet need a model vLLM serves like any Hugging Face checkpoint,
yet nothing may be downloaded at run time. A ByteLevel BPE tokenizer trained here on
generated text (so any text tokenizes, and the documents below take about one token a
word), and a 2-layer, 128-wide Llama with random weights from a fixed seed: about 3 MB,
built in seconds, and every build gives the same tokens and the same weights. What it
generates is noise; the KV cache of its prompts is what the tests measure.

A second model for a second pool takes another weights seed (`--weights-seed`): the same
tokenizer, other weights. A LoRA adapter of a model (`--adapter-of MODEL_DIR`, peft in the
vLLM venv) has rank 8 on q_proj and v_proj with random weights from its seed, so it changes
what the model computes: vLLM keys its cache apart from the base model's.

This file runs under the vLLM venv's python, which has tokenizers, transformers, torch and
peft but not our packages, so it imports only the standard library at module level:

    .venv-vllm/bin/python tools/prefix_sidecar_tools/vllm/tiny_model.py OUT_DIR
        [--weights-seed N] [--adapter-of MODEL_DIR]

`document()` is also what the tests and benches send: the same generator feeds the
tokenizer's training corpus and the prompts, so prompts tokenize compactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

# Part of the recipe: change any of these and the cached model is rebuilt (see RECIPE).
SEED = 2028
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
LEXICON_SIZE = 2500
CORPUS_DOCUMENTS = 400
CORPUS_WORDS = 600
MODEL_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 32768,
}
# Each turn opens with <s> and its role, and closes with </s>; the generation prompt opens
# the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_SYLLABLE_TEXT = (
    "ka ri to me sa lo ven dar pel mu tin gor bea shi lan qui or es al un de ro "
    "na xi po ju fen wel cra sto mi bru"
)
_DOMAIN_TEXT = (
    "the and of to in for on with is are be by this that from or as at not each all any "
    "per rule store price discount coupon order merchant category commission rate product "
    "promotion sale stream banned law must may shall total item buyer seller refund days "
    "yuan percent off limit priority platform compliance check section clause table"
)
_SYLLABLES = tuple(_SYLLABLE_TEXT.split())
_DOMAIN_WORDS = tuple(_DOMAIN_TEXT.split())
RECIPE = json.dumps(
    {
        "seed": SEED,
        "vocab": VOCAB_SIZE,
        "specials": SPECIAL_TOKENS,
        "lexicon": [LEXICON_SIZE, _SYLLABLE_TEXT, _DOMAIN_TEXT],
        "corpus": [CORPUS_DOCUMENTS, CORPUS_WORDS],
        "shape": MODEL_SHAPE,
        "chat_template": CHAT_TEMPLATE,
    },
    sort_keys=True,
)
RECIPE_FILE = "recipe.json"  # written last: a folder holding it is a complete build


def lexicon(seed: int = SEED) -> list[str]:
    """The words documents are made of: domain words first (the most frequent), then
    made-up words of two to four syllables."""
    rng = random.Random(f"lexicon-{seed}")
    words = list(_DOMAIN_WORDS)
    seen = set(words)
    while len(words) < LEXICON_SIZE:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


_LEXICON = lexicon()
_WEIGHTS = [1.0 / (rank + 1) for rank in range(len(_LEXICON))]  # Zipf over the lexicon


def document(key: str, words: int) -> str:
    """A deterministic text of `words` words (the same key and length, the same text):
    sentences of Zipf-drawn words, with section numbers and punctuation."""
    rng = random.Random(f"document-{SEED}-{key}")
    drawn = rng.choices(_LEXICON, weights=_WEIGHTS, k=words)
    pieces: list[str] = []
    sentence = 0
    for index, word in enumerate(drawn):
        if sentence == 0:
            word = word.capitalize()
        sentence += 1
        if index + 1 == words or (sentence > 6 and rng.random() < 0.15):
            word += "."
            sentence = 0
        elif rng.random() < 0.05:
            word += ","
        elif rng.random() < 0.02:
            word = f"{word} {rng.randint(1, 999)}"
        pieces.append(word)
    return " ".join(pieces)


def recipe(weights_seed: int = SEED, adapter_of: str = "") -> str:
    """What a build is made from: RECIPE, and another weights seed or the adapter's base."""
    if weights_seed == SEED and not adapter_of:
        return RECIPE
    return json.dumps({"base": RECIPE, "weights_seed": weights_seed, "adapter_of": adapter_of})


def build(out_dir: Path, weights_seed: int = SEED) -> Path:
    """Train the tokenizer, make the model, save both into `out_dir` (replaced whole, via
    a sibling folder renamed into place, so a reader never sees half a build)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    staging = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    bpe = ByteLevelBPETokenizer()
    corpus = (document(f"corpus-{n}", CORPUS_WORDS) for n in range(CORPUS_DOCUMENTS))
    bpe.train_from_iterator(
        corpus, vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS)
    )
    unk, bos, eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(staging)

    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=ids[1],
        eos_token_id=ids[2],
        pad_token_id=ids[3],
        tie_word_embeddings=False,
        torch_dtype="float32",
        **MODEL_SHAPE,
    )
    torch.manual_seed(weights_seed)
    LlamaForCausalLM(config).save_pretrained(staging, safe_serialization=True)
    (staging / RECIPE_FILE).write_text(recipe(weights_seed), encoding="utf-8")
    return _in_place(staging, out_dir)


def build_adapter(model_dir: Path, out_dir: Path, weights_seed: int = SEED) -> Path:
    """A LoRA adapter of the model in `model_dir`: rank 8 on q_proj and v_proj, random
    weights from `weights_seed` (not peft's zero init, which would change nothing)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    staging = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    torch.manual_seed(weights_seed)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), lora).save_pretrained(staging)
    (staging / RECIPE_FILE).write_text(recipe(weights_seed, str(model_dir)), encoding="utf-8")
    return _in_place(staging, out_dir)


def _in_place(staging: Path, out_dir: Path) -> Path:
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def is_built(out_dir: Path, weights_seed: int = SEED, adapter_of: str = "") -> bool:
    """True when `out_dir` holds a complete build of this recipe."""
    try:
        text = (out_dir / RECIPE_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return text == recipe(weights_seed, adapter_of)


if __name__ == "__main__":
    args = sys.argv[1:]
    seed = SEED
    if "--weights-seed" in args:
        at = args.index("--weights-seed")
        seed = int(args[at + 1])
        del args[at : at + 2]
    base = ""
    if "--adapter-of" in args:
        at = args.index("--adapter-of")
        base = args[at + 1]
        del args[at : at + 2]
    if len(args) != 1:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [--weights-seed N] [--adapter-of MODEL_DIR]")
    out = Path(args[0]).resolve()
    print(build_adapter(Path(base).resolve(), out, seed) if base else build(out, seed))
