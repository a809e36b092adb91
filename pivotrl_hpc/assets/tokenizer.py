"""A small word-level tokenizer built locally (no hub): digits, arithmetic, a few words.

Digits are split one per token so that numbers of any size are representable and answers
can be checked exactly after decoding.
"""
from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
SYMBOLS = list("0123456789") + ["+", "-", "*", "=", "?", ":", ".", ",", "(", ")"]
WORDS = ["what", "is", "the", "answer", "problem", "solution", "score", "judge", "correct",
         "wrong", "verdict", "compute", "result", "so", "then", "yes", "no", "boxed"]


def vocabulary(size: int) -> dict[str, int]:
    """Specials, symbols, words, then filler tokens `w<i>` up to `size` entries."""
    tokens = SPECIALS + SYMBOLS + WORDS
    if size < len(tokens):
        raise ValueError(f"vocab_size {size} is smaller than the {len(tokens)} fixed tokens")
    tokens += [f"w{i}" for i in range(len(tokens), size)]
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer(vocab_size: int):
    """Return a transformers PreTrainedTokenizerFast over `vocabulary(vocab_size)`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(),
    ])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
