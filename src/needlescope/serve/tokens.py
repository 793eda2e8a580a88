"""The HTTP side's tokenizer: chat templates, encoding and decoding, off the event loop.

Tokenising a long text takes a while (a 10 MB body took half a minute), and while it ran on
the event loop ``/health`` and ``/metrics`` waited. Every call here runs on one dedicated
thread (one, because a fast tokenizer's Rust object refuses concurrent mutable use: "Already
borrowed"), so the loop stays free. Before tokenising, a text longer than any
``context_length``-token text can be is refused from its length in characters
(``max_token_chars``: the longest vocabulary entry), so an oversized prompt costs no tokenising;
a chat is also refused from its number of messages (``tokens_per_message``: what the chat
template adds around even an empty message, measured once), so 100,000 one-character messages
cost no rendering either.

The thread's queue is bounded (``max_pending``: twice the requests the engine can hold): a call
beyond it is refused at once with ``Overloaded`` (HTTP 503), as the engine's queue refuses, so
one client's flood of tokenising cannot hold up everyone else's small requests.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from needlescope.serve.errors import BadValue, ContextOverflow, Overloaded

__all__ = ["Tokens"]


class Tokens:
    def __init__(self, tokenizer, context_length: int, max_pending: int = 64, metrics=None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = len(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # An upper bound on characters per token (byte-level BPE stores one character per byte).
        self.max_token_chars = max(1, max(len(t) for t in tokenizer.get_vocab()))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="needlescope-tokenize")
        self.max_pending = max_pending
        self._pending = 0
        self.metrics = metrics
        self.tokens_per_message: int | None = None  # measured on the first chat (tokenizer thread)

    def _template_tokens_per_message(self) -> int:
        """The fewest tokens the chat template adds per message (at least 1): the rendered
        length of two empty messages less that of one."""
        pairs = (
            [{"role": "user", "content": ""}],
            [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        )
        try:
            one, two = (len(self._chat_ids(list(m), False)) for m in pairs)
        except BadValue:
            return 1
        return max(1, two - one)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        if self._pending >= self.max_pending:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise Overloaded(
                f"the tokenizer has {self._pending} requests waiting (max {self.max_pending}); retry later"
            )
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    def _precheck(self, text: str) -> None:
        if len(text) > self.context_length * self.max_token_chars:
            raise ContextOverflow(self.context_length, None, None, chars=len(text))

    async def chat_ids(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the checkpoint's chat template.

        ``continue_final_message`` (vLLM's): the last message is left open, so the model goes
        on with its text instead of starting a new turn; it cannot be combined with
        ``add_generation_prompt`` (vLLM refuses the pair the same way)."""
        if continue_final_message and add_generation_prompt:
            raise BadValue(
                "continue_final_message",
                "cannot be combined with add_generation_prompt=true; set add_generation_prompt to false",
            )
        self._precheck("".join(m["content"] for m in messages))
        if self.tokens_per_message is None:
            self.tokens_per_message = await self._run(self._template_tokens_per_message)
        if len(messages) * self.tokens_per_message > self.context_length:
            raise ContextOverflow(
                self.context_length, None, None, messages=len(messages), per_message=self.tokens_per_message
            )
        return await self._run(self._chat_ids, messages, add_generation_prompt, continue_final_message)

    def _chat_ids(
        self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool = False
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        except Exception as exc:  # jinja raises TemplateError (e.g. unknown role) and friends
            raise BadValue("prompt", f"cannot be rendered with the chat template: {exc}") from exc
        return self._encode(text, False)

    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._precheck(text)
        return await self._run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.check_ids(ids)
        return await self._run(lambda: self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._run(self.tokenizer.convert_ids_to_tokens, ids)

    def check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadValue("prompt", f"holds token ids out of range 0..{self.vocab_size - 1}: {bad[:8]}")
