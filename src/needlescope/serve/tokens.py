"""The HTTP side's tokenizer: chat templates, encoding and decoding, off the event loop.

Tokenising a long text takes a while (a 10 MB body took half a minute), and while it ran on
the event loop ``/health`` and ``/metrics`` waited. Every call here runs on one dedicated
thread (one, because a fast tokenizer's Rust object refuses concurrent mutable use: "Already
borrowed"), so the loop stays free. Before tokenising, a text longer than any
``context_length``-token text can be is refused from its length in characters
(``max_token_chars``: the longest vocabulary entry), so an oversized prompt costs no tokenising.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from needlescope.serve.errors import BadValue, ContextOverflow

__all__ = ["Tokens"]


class Tokens:
    def __init__(self, tokenizer, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = len(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # An upper bound on characters per token (byte-level BPE stores one character per byte).
        self.max_token_chars = max(1, max(len(t) for t in tokenizer.get_vocab()))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="needlescope-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _precheck(self, text: str) -> None:
        if len(text) > self.context_length * self.max_token_chars:
            raise ContextOverflow(self.context_length, None, None, chars=len(text))

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the checkpoint's chat template."""
        self._precheck("".join(m["content"] for m in messages))
        return await self._run(self._chat_ids, messages, add_generation_prompt)

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises TemplateError (e.g. unknown role) and friends
            raise BadValue("prompt", f"cannot be rendered with the chat template: {exc}") from exc
        return self._encode(text, False)

    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._precheck(text)
        return await self._run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, ids: list[int]) -> str:
        self.check_ids(ids)
        return await self._run(lambda: self.tokenizer.decode(ids, skip_special_tokens=True))

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._run(self.tokenizer.convert_ids_to_tokens, ids)

    def check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadValue("prompt", f"holds token ids out of range 0..{self.vocab_size - 1}: {bad[:8]}")
