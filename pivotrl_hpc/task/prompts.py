"""Chat messages -> prompt token ids, with a model folder's own tokenizer and chat template.

`AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders the text
(the template adds whatever BOS and turn markers the model was trained with); the text is then
encoded without adding special tokens again, as vLLM's chat entry does. `enable_thinking` is
passed only to a template that reads it (Qwen3's), since others ignore or reject it. A folder
without a chat template is an error unless the config says `chat_template: none`, which feeds
the messages' text joined by blank lines, after the tokenizer's BOS if it has one.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pivotrl_hpc.task.errors import TaskError

CHAT_TEMPLATES = ("model", "none")


class ChatRenderer:
    def __init__(self, model_dir: str | Path, chat_template: str = "model",
                 enable_thinking: bool | None = None, key: str = "models.policy.path",
                 none_key: str = "data.chat_template") -> None:
        from transformers import AutoTokenizer

        if chat_template not in CHAT_TEMPLATES:
            raise TaskError(none_key, f"{chat_template!r} is not one of "
                                      f"{', '.join(CHAT_TEMPLATES)}")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, ...
            raise TaskError(key, f"{model_dir}: no usable tokenizer ({type(e).__name__}: "
                                 f"{e})") from None
        self.mode, self.size = chat_template, len(self.tok)
        if self.mode == "model" and not self.tok.chat_template:
            raise TaskError(key, f"{model_dir} has no chat template (tokenizer_config.json "
                                 "'chat_template' or chat_template.jinja); add the model's, or "
                                 f"set {none_key}: none to feed the raw prompt text")
        takes = self.mode == "model" and "enable_thinking" in str(self.tok.chat_template)
        self.kwargs = {"enable_thinking": enable_thinking} if (
            takes and enable_thinking is not None) else {}
        # what `tok.decode` ends in for a fast tokenizer without clean-up: its Rust decode,
        # called directly (the wrapper's per-id conversion was half a decode's time)
        backend = getattr(self.tok, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None and not getattr(
            self.tok, "clean_up_tokenization_spaces", True) else None

    @property
    def eos_id(self) -> int | None:
        return self.tok.eos_token_id

    def text(self, messages: Sequence[dict[str, str]]) -> str:
        if self.mode == "none":
            body = "\n\n".join(m["content"] for m in messages)
            return (self.tok.bos_token or "") + body
        return self.tok.apply_chat_template(list(messages), tokenize=False,
                                            add_generation_prompt=True, **self.kwargs)

    def ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(self.text(messages))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Generated ids -> text, special tokens (EOS, pad) dropped; <think> tags are added
        tokens, not special ones, in Qwen's and the tiny tokenizer, so they stay."""
        n = self.size   # ids past the tokenizer (a model's padded vocabulary) decode to nothing
        kept = [i for i in map(int, ids) if 0 <= i < n]
        if self._backend_decode is not None:
            return self._backend_decode(kept, skip_special_tokens=True)
        return self.tok.decode(kept, skip_special_tokens=True)
