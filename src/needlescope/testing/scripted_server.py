"""A scripted OpenAI-compatible server (stdlib only) with a known recall window and injectable faults.

Tokenizer: whitespace words. The rendered prompt is, per message, ``<|role|> content``, then the
generation prompt ``<|assistant|>``; its token count is its number of words. A needle is answered
only when its fact "The <key> is <digits>." lies within the LAST ``--window`` words.

    python -m needlescope.testing.scripted_server --port 0 --window 500 [--fail-every 3 --fail-status 500] ...

Planted answer faults (this instance only, so replicas can differ): ``--fault KIND`` turns a right
answer into one failure kind of the taxonomy (``near_miss``, ``partial``, ``distractor``,
``refusal``, ``empty``, ``length``, ``reasoning``, ``unrelated``), or into the right answer of the
chat served before it (``stale``: a response cache reused across requests). It fires when the
prompt has at least ``--fault-from`` tokens, when ``--fault-residue M:R`` is given only if its
length is R mod M, when ``--fault-depth LO:HI`` is given only if the needle's fact starts between
LO% and HI% of the prompt's words, and then with probability ``--fault-rate`` (drawn from
``--fault-seed``; 1.0 is deterministic). ``--fault-ramp W`` (tokens) makes the rate a logistic
ramp instead of a step: ``rate / (1 + exp(-(n - fault_from) / W))`` at every length n, so recall
falls smoothly through ``--fault-from`` (a noisy collapse, for the bisection's coverage bench). ``--truncate-middle N`` imitates a serving layer that fits
long prompts by dropping their middle: a prompt of more than N words keeps its first N // 2 and
last N - N // 2 words (the ``--window`` applies to what is left).
Serving state (the live factor experiment's ground truth, ``needlescope serving-factors``):
``--fault-when COND`` fires the fault only in a serving state, a ``+``-joined conjunction of
``cache_hit`` (the prompt's cached prefix covers at least half its words), ``batch>K`` (the chat
shares its batch with more than K requests), ``draft>D`` (speculative draft depth above D) and
``chunked`` (the prompt is prefilled in more than one chunk and the needle's fact starts before
the last chunk boundary: the state carried across a boundary is lost); ``always`` (the default)
is no condition. ``--speculative-num-draft-tokens N`` and ``--prefill-chunk C`` are launch flags
(0: off) that a request's ``speculative_num_draft_tokens`` / ``prefill_chunk`` fields override.
``--batch-window-s S`` makes a static batch window: a chat opens a batch (or joins the open one),
which closes S seconds after it opened; every member answers after the close, and the batch's size
is its member count (0 s: the chats in flight when it arrived). Each answer's usage reports
``batch`` ``{size, joined_mid_flight}`` and, with a draft depth, ``speculative``
``{num_draft_tokens, acceptance_rate}`` (emulated: 1.0, or 0.5 where the fault fired). An echo task
("Repeat these N numbers exactly, in order, separated by spaces: ...") is answered by copying.
``--replica-id`` adds an ``X-Replica-Id`` header, as a router in front of replicas might;
``--page-size`` is only reported in ``/get_server_info`` (a kernel boundary for bisection).

Peer quirks it can imitate: ``--api-key`` (every route but /health needs the Bearer key),
``--models empty|error`` (transformers serve lists nothing or fails /v1/models), ``--no-tokenize``,
``--trained-value-digits N`` (advertised in /get_server_info), ``--max-concurrent K`` (an admission
queue: chats beyond K in flight get 503 with Retry-After) and ``--die-after N`` (the process exits
after N chats, like a crashed server).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from needlescope.serve.parent_watch import exit_with_parent

# "What is the <key>?" (single, multikey, multiturn) or "What are all the <key>?" (multivalue).
QUESTION = re.compile(r"what\s+(?:is|are)\s+(?:all\s+)?the\s+(.+?)\s*\?", re.IGNORECASE)
# The value list after "<key> is|are": "12345", or "1, 2 and 3" for multivalue.
VALUES = r"(\d+(?:\s*(?:,|and|,\s*and)\s+\d+)*)"
# Any stated fact: used to answer with another key's value (the distractor fault).
ANY_FACT = re.compile(r"\bis\s+(\d+)\.", re.IGNORECASE)
# The echo probe's exact-copy task (``cases.echo``): the numbers after the colon, copied.
ECHO = re.compile(
    r"repeat these \d+ numbers exactly, in order, separated by spaces:\s*([\d\s]+)", re.IGNORECASE
)
FAULTS = (
    "near_miss",
    "partial",
    "distractor",
    "refusal",
    "empty",
    "length",
    "reasoning",
    "unrelated",
    "stale",
)


def render_words(messages: list[dict], add_generation_prompt: bool = True) -> list[str]:
    words: list[str] = []
    for m in messages:
        words.extend(f"<|{m.get('role', 'user')}|> {m.get('content') or ''}".split())
    if add_generation_prompt:
        words.append("<|assistant|>")
    return words


def _fact(messages: list[dict]) -> re.Pattern | None:
    """The pattern of the asked key's fact ("<key> is|are <values>"), or None without a question."""
    question = next(
        (QUESTION.search(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"),
        None,
    )
    if question is None:
        return None
    key = " ".join(question.group(1).split())
    return re.compile(
        r"\b" + r"\s+".join(map(re.escape, key.split())) + r"\s+(?:is|are)\s+" + VALUES, re.IGNORECASE
    )


def answer(messages: list[dict], window: int, truncate_middle: int = 0) -> str:
    words = render_words(messages)
    fact = _fact(messages)
    if fact is None:
        return "I don't know"
    if truncate_middle and len(words) > truncate_middle:
        words = words[: truncate_middle // 2] + words[len(words) - (truncate_middle - truncate_middle // 2) :]
    visible = " ".join(words[-window:]) if window > 0 else ""
    values = list(dict.fromkeys(v for found in fact.findall(visible) for v in re.findall(r"\d+", found)))
    return ", ".join(values) if values else "I don't know"


def echo_answer(messages: list[dict]) -> str | None:
    """The copied numbers of an echo task in the last user message; None when it is no echo task."""
    last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
    found = ECHO.search(last)
    return " ".join(found.group(1).split()) if found else None


def needle_depth(messages: list[dict]) -> float | None:
    """Where the asked key's fact starts, in percent of the rendered prompt's words (None: no fact)."""
    fact = _fact(messages)
    text = " ".join(render_words(messages))
    found = fact.search(text) if fact is not None else None
    if found is None:
        return None
    return 100.0 * len(text[: found.start()].split()) / max(1, len(text.split()))


def _before_last_boundary(serving: dict, messages: list[dict]) -> bool:
    """Prefilled in chunks of ``serving["chunk"]`` words, the needle's fact starts before the last
    chunk boundary (the state it left behind was carried across a boundary)."""
    chunk, words = serving["chunk"], serving["words"]
    depth = needle_depth(messages)
    if chunk <= 0 or chunk >= words or depth is None:
        return False
    return depth * words / 100.0 < (words - 1) // chunk * chunk


def _shift(digits: str) -> str:
    return "".join(str((int(c) + 5) % 10) for c in digits)


def planted(fault: str, right: str, messages: list[dict]) -> tuple[str, str | None, str]:
    """(content, reasoning_content, finish_reason) of fault ``fault`` applied to the right answer."""
    value = right.split(",")[0].strip()
    if fault == "near_miss":  # the last digit wrong: edit distance 1
        return value[:-1] + str((int(value[-1]) + 1) % 10), None, "stop"
    if fault == "partial":  # the first three digits right, then wrong
        return value[:3] + _shift(value[3:]) + "1", None, "stop"
    if fault == "distractor":
        text = " ".join(m.get("content") or "" for m in messages)
        others = [v for v in ANY_FACT.findall(text) if v not in right]
        return (others[0] if others else "The river was calm."), None, "stop"
    if fault == "refusal":
        return "I could not find that information in the text.", None, "stop"
    if fault == "empty":
        return "", None, "stop"
    if fault == "length":
        return value[:1], None, "length"
    if fault == "reasoning":
        return "", "Let me go through the text and find the code that was", "length"
    return "The weather in the valley was pleasant that morning.", None, "stop"


class State:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.lock = threading.Lock()
        self.n_chat = 0
        self.n_finished = 0
        self.in_flight = 0
        self.rejected = 0
        self.history: list[list[str]] = []
        self.rng = random.Random(opts.fault_seed)
        self.last_right: str | None = None
        self.batch: list = [0.0, 0]  # the open batch: [closes at (monotonic s), members]

    def join_batch(self) -> int:
        """Join the open batch (or open one), wait for it to close; its size. Without a window,
        the chats in flight on arrival (this one included)."""
        window = self.opts.batch_window_s
        with self.lock:
            if window <= 0:
                return self.in_flight
            now = time.monotonic()
            if self.batch[0] <= now:
                self.batch = [now + window, 0]
            batch = self.batch
            batch[1] += 1
        time.sleep(max(0.0, batch[0] - time.monotonic()))
        return batch[1]

    def state_holds(self, serving: dict, messages: list[dict]) -> bool:
        """Whether every condition of ``--fault-when`` holds in this chat's serving state
        (``serving``: words, cached, batch, draft, chunk)."""
        for cond in self.opts.fault_when:
            if cond == "cache_hit" and 2 * serving["cached"] < serving["words"]:
                return False
            if cond.startswith("batch>") and serving["batch"] <= int(cond[6:]):
                return False
            if cond.startswith("draft>") and serving["draft"] <= int(cond[6:]):
                return False
            if cond == "chunked" and not _before_last_boundary(serving, messages):
                return False
        return True

    def stale(self, right: str) -> str:
        """The right answer of the chat served before this one (a stale cache slot); keeps ``right``."""
        with self.lock:
            previous, self.last_right = self.last_right, right
        return previous if previous is not None else right

    def fault_fires(self, n_tokens: int, messages: list[dict], serving: dict) -> bool:
        o = self.opts
        if o.fault is None or (n_tokens < o.fault_from and o.fault_ramp <= 0):
            return False
        if not self.state_holds(serving, messages):
            return False
        if o.fault_residue is not None:
            mod, res = o.fault_residue
            if n_tokens % mod != res:
                return False
        if o.fault_depth is not None:
            depth = needle_depth(messages)
            if depth is None or not o.fault_depth[0] <= depth <= o.fault_depth[1]:
                return False
        rate = o.fault_rate
        if o.fault_ramp > 0:
            rate /= 1 + math.exp(-(n_tokens - o.fault_from) / o.fault_ramp)
        if rate >= 1.0:
            return True
        with self.lock:
            return self.rng.random() < rate

    def next_chat(self) -> int:
        with self.lock:
            self.n_chat += 1
            return self.n_chat

    def finished_chat(self) -> None:
        with self.lock:
            self.n_finished += 1

    def drain(self, n: int, timeout_s: float = 10.0) -> None:
        """Wait until chats 1..``n`` have answered (or ``timeout_s`` passed).

        Why: ``--die-after N`` promises N answers; a concurrent chat N+1 that crashed the
        process at once would drop answers still being written, and a test of "2 answered,
        then gone" would see 0 answered on a busy machine."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.n_finished >= n:
                    return
            time.sleep(0.005)

    def cached(self, words: list[str]) -> int:
        with self.lock:
            best = 0
            for prev in self.history:
                n = 0
                for a, b in zip(prev, words, strict=False):  # prefixes differ in length
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self.history.append(words)
            del self.history[:-256]  # bounded memory for long runs
            return best


class Handler(BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the body waits for the client's delayed
    # ACK (about 40 ms a request on Linux loopback).
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:  # quiet: tests read only READY from stdout
        return

    def _send(self, status: int, body: object, headers: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def _authorized(self) -> bool:
        key = self.state.opts.api_key
        if not key or self.path == "/health" or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send(401, {"error": {"message": "missing or wrong API key; pass --api-key"}})
        return False

    def do_GET(self) -> None:
        o = self.state.opts
        if not self._authorized():
            return
        if self.path == "/v1/models" and o.models == "error":
            self._send(500, {"error": {"message": "cannot list models"}})
        elif self.path == "/v1/models":
            listed = (
                []
                if o.models == "empty"
                else [{"id": o.model, "object": "model", "max_model_len": o.max_len}]
            )
            self._send(200, {"object": "list", "data": listed})
        elif self.path == "/get_server_info":
            self._send(
                200,
                {
                    "model_path": o.model,
                    "context_length": o.max_len,
                    "window": o.window,
                    **({"page_size": o.page_size} if o.page_size else {}),
                    "api_key": "sk-should-be-stripped",
                    "nested": {"hf_token": "hf_secret", "ok": 1},
                    **({"trained_value_digits": o.trained_value_digits} if o.trained_value_digits else {}),
                },
            )
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError:
            self._send(400, {"error": {"message": "invalid JSON body"}})
            return
        if not self._authorized():
            return
        if self.path == "/v1/chat/completions":
            self._admitted_chat(body)
        elif self.path == "/tokenize" and not self.state.opts.no_tokenize:
            if "messages" in body:
                words = render_words(body["messages"], body.get("add_generation_prompt", True))
            else:
                words = str(body.get("prompt", "")).split()
            self._send(
                200,
                {
                    "count": len(words),
                    "tokens": list(range(len(words))),
                    "max_model_len": self.state.opts.max_len,
                },
            )
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def _admitted_chat(self, body: dict) -> None:
        st = self.state
        with st.lock:
            full = bool(st.opts.max_concurrent) and st.in_flight >= st.opts.max_concurrent
            st.rejected += full
            st.in_flight += not full
        if full:
            self._send(503, {"error": {"message": "admission queue full"}}, {"Retry-After": "0.05"})
            return
        try:
            self._chat(body)
        finally:
            with st.lock:
                st.in_flight -= 1

    def _chat(self, body: dict) -> None:
        o = self.state.opts
        n = self.state.next_chat()
        if o.die_after and n > o.die_after:
            self.state.drain(o.die_after)
            os._exit(1)  # a crash: no answer, the connection drops, nothing listens any more
        try:
            self._answer(body, n)
        finally:
            self.state.finished_chat()

    def _answer(self, body: dict, n: int) -> None:
        o = self.state.opts
        if o.model != body.get("model"):
            self._send(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
            return
        if o.fail_every and n % o.fail_every == 0:
            self._send(o.fail_status, {"error": {"message": "scripted failure"}}, {"Retry-After": "0"})
            return
        if o.drop_every and n % o.drop_every == 0:
            # Close without any response: the client sees a connection error.
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if o.garbage_every and n % o.garbage_every == 0:
            self._send(200, b"{not json")
            return
        if o.slow_every and n % o.slow_every == 0:
            time.sleep(o.slow_s)
        messages = body.get("messages") or []
        words = render_words(messages)
        if len(words) > o.max_len:
            self._send(
                400,
                {
                    "error": {
                        "message": f"This model's maximum context length is {o.max_len} tokens; prompt too long"
                    }
                },
            )
            return
        serving = self._serving(body, words)
        echo = echo_answer(messages)
        text = echo if echo is not None else answer(messages, o.window, o.truncate_middle)
        reasoning, finish = None, "stop"
        right = text
        fired = text[:1].isdigit() and self.state.fault_fires(len(words), messages, serving)
        if fired:
            if o.fault == "stale":
                text = self.state.stale(right)
            else:
                text, reasoning, finish = planted(o.fault, text, messages)
        elif text[:1].isdigit() and o.fault == "stale":
            self.state.stale(right)
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": len(text.split()),
            "total_tokens": len(words) + len(text.split()),
            "prompt_tokens_details": {"cached_tokens": serving["cached"]},
            "batch": {"size": serving["batch"], "joined_mid_flight": 0},
        }
        if serving["draft"] > 0:
            usage["speculative"] = {
                "num_draft_tokens": serving["draft"],
                "acceptance_rate": 0.5 if fired else 1.0,
            }
        self._send(
            200,
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "model": o.model,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "message": {"role": "assistant", "content": text, "reasoning_content": reasoning},
                    }
                ],
                "usage": usage,
            },
            {"X-Replica-Id": o.replica_id} if o.replica_id else None,
        )

    def _serving(self, body: dict, words: list[str]) -> dict:
        """This chat's serving state: its cached prefix, batch, draft depth and prefill chunk
        (a request's field overrides the launch flag)."""
        o = self.state.opts
        draft = body.get("speculative_num_draft_tokens", o.speculative_num_draft_tokens)
        chunk = body.get("prefill_chunk", o.prefill_chunk)
        return {
            "words": len(words),
            "cached": self.state.cached(words),
            "batch": self.state.join_batch(),
            "draft": draft if isinstance(draft, int) else 0,
            "chunk": chunk if isinstance(chunk, int) else 0,
        }


def _residue(text: str) -> tuple[int, int]:
    mod, res = (int(x) for x in text.split(":"))
    if mod < 1 or not 0 <= res < mod:
        raise argparse.ArgumentTypeError(f"--fault-residue M:R needs 0 <= R < M; got {text!r}")
    return mod, res


def _band(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(":"))
    if not 0 <= lo <= hi <= 100:
        raise argparse.ArgumentTypeError(f"--fault-depth LO:HI needs 0 <= LO <= HI <= 100; got {text!r}")
    return lo, hi


def _conditions(text: str) -> tuple[str, ...]:
    """``--fault-when``: ``always``, or conditions joined by ``+`` (module docstring)."""
    if text == "always":
        return ()
    conds = tuple(c.strip() for c in text.split("+"))
    for c in conds:
        ok = c in ("cache_hit", "chunked") or (c.startswith(("batch>", "draft>")) and c[6:].isdigit())
        if not ok:
            raise argparse.ArgumentTypeError(
                f"--fault-when takes always or cache_hit, batch>K, draft>D, chunked joined by +; got {c!r}"
            )
    return conds


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The scripted server's options, every default filled (tests that embed the handler use it too)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--model", default="scripted")
    p.add_argument("--max-len", type=int, default=1_000_000)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-status", type=int, default=500, choices=(429, 500, 502, 503))
    p.add_argument("--drop-every", type=int, default=0)
    p.add_argument("--slow-every", type=int, default=0)
    p.add_argument("--slow-s", type=float, default=1.0)
    p.add_argument("--garbage-every", type=int, default=0)
    p.add_argument("--fault", choices=FAULTS, default=None)
    p.add_argument("--fault-from", type=int, default=0)
    p.add_argument("--fault-residue", type=_residue, default=None, help="M:R")
    p.add_argument("--fault-depth", type=_band, default=None, help="LO:HI, percent of the prompt's words")
    p.add_argument("--truncate-middle", type=int, default=0, help="keep the first and last N/2 words")
    p.add_argument("--fault-rate", type=float, default=1.0)
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--fault-ramp", type=float, default=0.0, help="logistic width in tokens (0: a step)")
    p.add_argument("--fault-when", type=_conditions, default=(), help="always, or e.g. cache_hit+batch>1")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=0)
    p.add_argument("--batch-window-s", type=float, default=0.0)
    p.add_argument("--replica-id", default=None)
    p.add_argument("--page-size", type=int, default=0, help="reported in /get_server_info only")
    p.add_argument("--api-key", default=None)
    p.add_argument("--models", choices=("ok", "empty", "error"), default="ok")
    p.add_argument("--no-tokenize", type=int, default=0, help="1: answer /tokenize with 404")
    p.add_argument("--trained-value-digits", type=int, default=0)
    p.add_argument("--max-concurrent", type=int, default=0)
    p.add_argument("--die-after", type=int, default=0)
    return p.parse_args(argv)


class LoopbackServer(ThreadingHTTPServer):
    """A thread per connection, with a listen backlog for a concurrent client: the stdlib's 5
    made a client that opens 8 connections at once wait on TCP retransmissions (one run of 20
    chats at concurrency 8: 240 ms, 38 ms with this backlog; 540 ms vs 41 ms beside a busy core)."""

    daemon_threads = True
    request_queue_size = 128


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    exit_with_parent(os.environ)
    Handler.state = State(opts)
    server = LoopbackServer(("127.0.0.1", opts.port), Handler)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
