"""The tiny models' tokenizer: a byte-level BPE trained locally (no hub) with the `tokenizers`
library, the special tokens and chat template of Qwen's (ChatML), and `<think>`/`</think>`.

So a CPU run takes the same path as a real model: the prompt is rendered by the folder's own
chat template (`AutoTokenizer.apply_chat_template`), EOS is `<|im_end|>`, pad is
`<|endoftext|>`, and there is no BOS (as Qwen's). Byte-level: every text encodes, nothing
becomes <unk>. Digits are split one per token (as Qwen2's pre-tokenizer does), so any number
is representable. The merges are learned from a fixed corpus of the project's own task text
(`corpus`), so the tokenizer is the same on every machine.
"""
from __future__ import annotations

from collections.abc import Iterator

# Specials first, at fixed ids (the model configs name them): pad/EOS/chat markers.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END]
PAD_ID, IM_START_ID, EOS_ID = range(3)
THINK_ID, END_THINK_ID = 3, 4       # added tokens, not special: decoding keeps them
VOCAB_SIZE = 512

# Qwen3's chat template, trimmed to text: ChatML turns; `enable_thinking=false` closes an empty
# think block in the generation prompt, as Qwen3's does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}")


def corpus() -> Iterator[str]:
    """The text the merges are learned from: the synthetic task as the chat template and the
    DAPO prompt wrap it, the judge templates' words, numbers and answers."""
    import random

    from pivotrl_hpc.task.synthetic import DAPO_PREFIX, DAPO_SUFFIX, TINY_SUFFIX, make_split

    words = ("Answer: yes no correct wrong score judge verdict problem response solution "
             "reference answer Is the final \\boxed{} think step by step Let us compute the "
             "result so then is what Final Yes No Reasoning ground truth matches")
    for rec in make_split(seed=12345, n=400):
        yield f"{DAPO_PREFIX}{rec['problem']}{DAPO_SUFFIX}"
        yield f"{rec['problem']}{TINY_SUFFIX}"
        yield f"user\n{rec['problem']}\nassistant\n{THINK}\nLet us compute.\n{END_THINK}\n"
        yield f"So the result is {rec['answer']}.\nAnswer: {rec['answer']}\n"
    rng = random.Random(0)
    for _ in range(200):
        yield " ".join(rng.sample(words.split(), 6)) + f" \\boxed{{{rng.randint(0, 10)}}}"


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A transformers PreTrainedTokenizerFast: byte-level BPE of `vocab_size` entries (specials
    and the 256 bytes included) with the chat template; deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS + [THINK, END_THINK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(THINK, normalized=False, special=False),
                    AddedToken(END_THINK, normalized=False, special=False)])
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  model_max_length=32768)
    out.chat_template = CHAT_TEMPLATE
    ids = [out.convert_tokens_to_ids(t) for t in SPECIALS + [THINK, END_THINK]]
    assert ids == [PAD_ID, IM_START_ID, EOS_ID, THINK_ID, END_THINK_ID], ids
    return out
