"""A small Qwen-style tokenizer, trained locally (no hub).

Qwen's real vocabulary has 151,643 BPE tokens; with it the embeddings would be ~97% of a tiny
model. Instead a byte-level BPE with Qwen's normalizer (NFC) and pre-tokenizer regex is trained
on :data:`samcache.random_checkpoints._corpus.CORPUS` to exactly :data:`BPE_VOCAB_SIZE` tokens, and Qwen's 14
special tokens follow it at fixed ids (:data:`SPECIAL_TOKEN_IDS`), in Qwen's order, just as they
follow the BPE vocabulary in the real tokenizer (there at 151643..151656).

Token ids are canonical: the 256 byte symbols first (in the byte-level alphabet's order), then one
id per merge in training order. They depend only on the corpus, never on the seed.
"""

from __future__ import annotations

import functools

#: Qwen's pre-tokenizer regex (the same string as transformers' ``Qwen2Tokenizer``).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Size of the trained byte-level BPE vocabulary (256 byte symbols + 768 merges).
BPE_VOCAB_SIZE = 1024

#: Qwen's special tokens in Qwen's order; they take ids BPE_VOCAB_SIZE, BPE_VOCAB_SIZE + 1, ...
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: token -> id, e.g. ``<|image_pad|>`` -> 1036.
SPECIAL_TOKEN_IDS = {tok: BPE_VOCAB_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS)}

#: Number of ids the tokenizer knows (BPE + special tokens).
TOKENIZER_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)

#: InternVL's image markup, after Qwen's special tokens (ids 1038..1041) in the InternVL family's
#: tokenizer, under the attribute names ``InternVLProcessor`` reads from the tokenizer.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}


def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in GPT-2/Qwen order (printable bytes first)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


@functools.lru_cache(maxsize=1)
def train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the byte-level BPE on the built-in corpus: ``(vocab, merges)`` with canonical ids.

    Cached per process: every tiny checkpoint shares the same tokenizer.
    """
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from samcache.random_checkpoints._corpus import CORPUS

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = _byte_alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, initial_alphabet=alphabet, show_progress=False, special_tokens=[]
    )
    tok.train_from_iterator([CORPUS], trainer)

    import json

    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab: dict[str, int] = {}
    for sym in alphabet:
        vocab.setdefault(sym, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) != BPE_VOCAB_SIZE or set(vocab) != set(model["vocab"]):
        raise RuntimeError(
            f"BPE training gave {len(vocab)} tokens, expected {BPE_VOCAB_SIZE}: the built-in corpus is too small"
        )
    return vocab, merges


def build_tokenizer(model_max_length: int = 32768, *, model_tokens: dict[str, str] | None = None):
    """A ``transformers.Qwen2Tokenizer`` over the trained BPE with Qwen's special tokens;
    ``model_tokens`` (e.g. :data:`INTERNVL_TOKENS`): more special tokens after them, each also
    reachable as the tokenizer attribute it is keyed by (``tok.context_image_token_id``)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = train_bpe()
    vocab = dict(vocab)
    vocab.update(SPECIAL_TOKEN_IDS)
    extra = list((model_tokens or {}).values())
    for i, token in enumerate(extra):
        vocab[token] = TOKENIZER_SIZE + i
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in merges],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]) + extra,
        **({"model_specific_special_tokens": dict(model_tokens)} if model_tokens else {}),
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *extra)],
                   special_tokens=True)
    want = {**SPECIAL_TOKEN_IDS, **{t: TOKENIZER_SIZE + i for i, t in enumerate(extra)}}
    got = {t: tok.convert_tokens_to_ids(t) for t in want}
    if got != want or len(tok) != TOKENIZER_SIZE + len(extra):
        raise RuntimeError(f"special tokens landed at {got} (len {len(tok)}), expected {want}")
    return tok
