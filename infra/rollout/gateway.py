"""The token-exact gateway: an OpenAI chat-completions endpoint per episode, in front of the rollout engine.

A third-party harness (its own prompts, parsers and loop) is pointed at ``{base_url}`` as at any
OpenAI server. Each request is rendered with the policy's chat template (``tools`` included, as
vLLM's server renders them: ``tokenizer.apply_chat_template``) and its ids are sent to the engine
through the episode's runner (:class:`GatewayEpisode`), which records every id, logprob and policy
version; tool calls are parsed with vLLM's own parser for the model family
(``vllm.tool_parsers``). The sampled ids are never re-tokenized:

* When a request's messages are the previous request's messages plus the reply returned for it plus
  new messages, its prompt ids are the previous prompt ids, the sampled ids, the template's turn
  closing and the new messages' rendered ids (``extends=True``): the episode stays one sequence.
* Otherwise (the harness summarised, truncated or rewrote its history, or ran a sub-agent) the
  request is rendered whole and starts a new segment (``extends=False``); the trainer scores each
  segment against exactly what the engine saw (``infra.store.Trajectory.segment_starts``).

Sampling parameters are the run's (the trainer computes logprobs under them); a request's
``temperature``/``top_p`` are overridden and counted. ``max_tokens`` is capped by the run's per-turn
budget and the context room. Errors are OpenAI-style bodies (``{"error": {"message", "type", "param",
"code"}}``; Anthropic's shape on its routes); an erroring request records nothing.

Routes: ``POST /e/{key}/v1/chat/completions``, ``POST /e/{key}/v1/responses`` (OpenAI's Responses API,
translated by :mod:`infra.rollout.wire_responses`), ``POST /e/{key}/v1/messages`` and
``.../messages/count_tokens`` (Anthropic's Messages API, :mod:`infra.rollout.wire_anthropic`),
``GET /e/{key}/v1/models`` (also
at ``/v1/...`` with ``Authorization: Bearer {key}`` or Anthropic's ``x-api-key: {key}``) and
``POST /e/{key}/sandbox/exec`` (an out-of-process harness runs commands in the episode's sandbox:
``{"command", "timeout_s"?, "shell"?}`` -> ``{"output", "exit_code", "timed_out", "duration_s"}``;
``"shell": false`` runs it under its own ``bash -c``, as Harbor's environments do, instead of in the
sandbox's persistent shell).
"""

# No `from __future__ import annotations`: FastAPI reads the route handlers' annotations at runtime.

import json
import logging
import math
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra.rollout.engine import Sample
from infra.rollout.gateway_errors import GatewayError, invalid_request

log = logging.getLogger(__name__)

UNSUPPORTED = {  # request field -> the value we serve (anything else is refused)
    "n": 1, "logit_bias": None, "use_beam_search": False, "echo": False, "top_logprobs": 0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "response_format": None, "prompt_logprobs": None,
    "continue_final_message": False, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
    "structured_outputs": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "chat_template": None, "chat_template_kwargs": None, "allowed_token_ids": None,
    "bad_words": [], "min_p": None, "repetition_penalty": None, "logprob_token_ids": None,
}
"""Parameters the trainer could not account for (they change the sampling distribution or the reply count)."""


class GatewayEpisode(Protocol):
    """The runner's side of one episode behind the gateway (``infra.rollout.collector``)."""

    max_model_len: int
    model_name: str

    def sample_ids(self, prompt_ids: list[int], extends: bool, max_tokens: int | None,
                   stop: tuple[str, ...]) -> Sample | str:
        """Sample on ``prompt_ids`` and record it; a str is why the episode refused (it has ended)."""

    def exec_command(self, command: str, timeout_s: float | None, shell: bool = True) -> dict | str:
        """Run ``command`` in the episode's sandbox (its shell, or ``bash -c``); a str: why not (it ended)."""

    def fail(self, reason: str) -> None:
        """End the episode as an infra failure (the gateway itself failed on one of its calls)."""

    def sample_side(self, prompt_ids: list[int], max_tokens: int | None, stop: tuple[str, ...]) -> Sample | str:
        """Sample on ``prompt_ids`` for a side call: answered by the policy, never put in the trained row."""

    def side_call(self, kind: str) -> None:
        """Count one side call of ``kind`` (``count_tokens``, ``models``, ``side_model``) in the episode's row."""


def _text(content: Any) -> str:
    """A message's content as text (a list of parts is joined, as vLLM's server does for text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object (templates render objects; a request carries JSON strings)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as the template needs them and as compared across calls (``None`` fields dropped).

    Content parts become text; tool-call arguments become objects (vLLM's server does the same before
    rendering: ``vllm.entrypoints.chat_utils``); keys: role, content, name, tool_calls, tool_call_id.
    """
    out = []
    for m in messages:
        n: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("name"):
            n["name"] = m["name"]
        if m.get("tool_call_id"):
            n["tool_call_id"] = m["tool_call_id"]
        if m.get("tool_calls"):
            n["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"].get("arguments", {}))}}
                               for c in m["tool_calls"]]
        out.append(n)
    return out


@dataclass
class Transcript:
    """One episode's conversation as sent: the messages and ids of the last call, for the extension check."""

    messages: list[dict] = field(default_factory=list)  # normalized, the reply included
    tools: Any = None
    calls: int = 0


def _context_exceeded(max_model_len: int, prompt_tokens: int) -> GatewayError:
    """The error vLLM's server gives for a prompt that leaves no room in the context."""
    return GatewayError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                        f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                        param="messages", code="context_length_exceeded")


def _unrenderable(err: Exception) -> GatewayError:
    """The error for messages the model's chat template cannot render."""
    return GatewayError(400, f"messages could not be rendered with the model's chat template: "
                        f"{type(err).__name__}: {err}", param="messages")


class ChatRenderer:
    """Renders requests with the tokenizer's chat template and extends a transcript by ids.

    Raises:
        ValueError: the template's assistant turn closing cannot be found (see ``ChatTokens``).
    """

    def __init__(self, tokenizer):
        from infra.rollout.chat_tokens import ChatTokens

        self.tokenizer = tokenizer
        self.chat = ChatTokens(tokenizer)

    def render(self, messages: list[dict], tools: Any, generation_prompt: bool) -> str:
        """The chat template's text for ``messages`` (and ``tools``, where the template renders them)."""
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def prompt(self, t: Transcript, messages: list[dict], tools: Any, history_ids: list[int]) -> tuple[list[int], bool]:
        """(prompt ids, extends): ids extending ``history_ids`` when ``messages`` extend ``t``, else rendered whole.

        ``history_ids``: the episode's current segment (last prompt plus its sampled ids).
        """
        full = self.render(messages, tools, True)
        n = len(t.messages)
        if t.calls and len(messages) > n and messages[:n] == t.messages and tools == t.tools and history_ids:
            before = self.render(t.messages, tools, False)
            closing = self.chat.turn_closing
            if full.startswith(before) and before.endswith(closing):
                eos = self.chat.eos_text
                if history_ids[-1] == self.chat.eos_token_id and eos and closing.startswith(eos):
                    closing = closing[len(eos):]
                tail = closing + full[len(before):]
                return history_ids + self.tokenizer.encode(tail, add_special_tokens=False), True
        return self.tokenizer.encode(full, add_special_tokens=False), False

    def ids(self, messages: list[dict], tools: Any) -> list[int]:
        """The whole prompt's ids for ``messages`` (rendered with the generation prompt), no transcript."""
        return self.tokenizer.encode(self.render(messages, tools, True), add_special_tokens=False)


@dataclass
class _Session:
    episode: GatewayEpisode
    transcript: Transcript = field(default_factory=Transcript)
    history_ids: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time per episode
    closed: bool = False  # set under ``lock`` by :meth:`Gateway.close`: no call changes the row after it
    responses: dict[str, list[dict]] = field(default_factory=dict)  # Responses API: id -> its messages and reply


@dataclass(frozen=True)
class Endpoint:
    """Where a harness reaches its episode: ``base_url`` (OpenAI base, ends in ``/v1``) and ``key``."""

    base_url: str
    key: str
    exec_url: str
    channel_base_url: str | None = None
    """The same OpenAI base as a sandbox on ``agentrl-egress`` reaches it (None: the gateway has no channel)."""

    @property
    def anthropic_base_url(self) -> str:
        """The base an Anthropic client takes (it appends ``/v1/messages``): ``base_url`` without ``/v1``."""
        return self.base_url.removesuffix("/v1")


class Gateway:
    """The HTTP server (uvicorn, a daemon thread, loopback); one :class:`Endpoint` per open episode.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders every request).
        tool_parser: a ``vllm.tool_parsers`` name (``hermes``, ``llama3_json``, ...) or "" for none.
        host: address to bind (loopback by default: harnesses run on this machine).
        side_models: model names whose completions are side calls (an agent's small-model calls for a title or
            a summary): sampled by the policy on their own prompt, answered, counted, never trained on.
        channel_host: also listen there, on a port of ``infra.egress.proxy.PORTS`` (the ``agentrl-egress``
            bridge: an agent installed in a sandbox reaches the gateway there and nothing else of the host).

    Raises:
        RuntimeError: the channel's address is not on this machine, or its ports are all taken.
    """

    def __init__(self, tokenizer, tool_parser: str = "hermes", host: str = "127.0.0.1",
                 channel_host: str | None = None, side_models: tuple[str, ...] = ()):
        self.renderer = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self.overridden: dict[str, int] = {}  # request sampling parameters overridden by the run's, counted
        self.refused = 0  # requests answered with an error
        self.calls = 0  # completions served
        self.overhead_s = 0.0  # seconds spent in the gateway itself (rendering, parsing), engine time excluded
        self.side_calls: dict[str, int] = {}  # calls answered but never trained on, by kind (see _side_call)
        self.side_models = frozenset(side_models)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._sockets = [self._sock]
        self.channel_url: str | None = None
        if channel_host is not None:
            from infra.egress.proxy import bind_in_range

            channel = bind_in_range(channel_host, "gateway channel")
            self._sockets.append(channel)
            self.channel_url = f"http://{channel_host}:{channel.getsockname()[1]}"
        self._server = None
        self._thread: threading.Thread | None = None
        self._start()

    # -- episodes ------------------------------------------------------------------------
    def open(self, episode: GatewayEpisode) -> Endpoint:
        """Register an episode; its harness reaches it at the returned endpoint until :meth:`close`."""
        key = "ep-" + secrets.token_hex(12)
        with self._lock:
            self._sessions[key] = _Session(episode)
        base = f"http://{self.host}:{self.port}/e/{key}"
        channel = f"{self.channel_url}/e/{key}/v1" if self.channel_url else None
        return Endpoint(base + "/v1", key, base + "/sandbox/exec", channel)

    def close(self, key: str) -> None:
        """Forget an episode: waits for a call in flight to finish recording, then refuses its key as unknown."""
        with self._lock:
            s = self._sessions.pop(key, None)
        if s is not None:
            with s.lock:
                s.closed = True

    def shutdown(self) -> None:
        """Stop the server thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _session(self, key: str) -> _Session:
        with self._lock:
            s = self._sessions.get(key)
        if s is None:
            raise GatewayError(401, f"unknown episode key '{key[:40]}': the key is not open on this gateway "
                               "(the episode ended, or the base URL is not one this run handed out)",
                               "authentication_error", code="invalid_api_key")
        return s

    def _side_call(self, session: _Session, kind: str) -> None:
        """Count a side call: the gateway's total and the episode's row (``side_calls``)."""
        with self._lock:
            self.side_calls[kind] = self.side_calls.get(kind, 0) + 1
        count = getattr(session.episode, "side_call", None)
        if count is not None:
            count(kind)

    def _fail(self, key: str) -> None:
        """An unexpected error serving ``key``: its episode ends as ``infra_failure/harness_error``."""
        with self._lock:
            s = self._sessions.get(key)
        if s is not None:
            s.episode.fail("harness_error")

    # -- the chat-completions call --------------------------------------------------------
    def complete(self, key: str, body: Any) -> dict:
        """Serve one chat-completions request body for episode ``key``; returns the OpenAI response dict.

        Raises:
            GatewayError: unknown key, malformed body, unsupported parameter, context window exceeded,
                or the episode has ended; nothing is recorded for the episode then.
        """
        session = self._session(key)
        request = self._parse(body)
        with session.lock:
            if session.closed:
                raise GatewayError(401, f"unknown episode key '{key[:40]}': the episode ended",
                                   "authentication_error", code="invalid_api_key")
            start = time.monotonic()
            ep = session.episode
            messages = normalize_messages(body["messages"])
            tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
            if request.tool_choice == "none":
                tools = None
            requested = body.get("max_completion_tokens", body.get("max_tokens"))
            if requested is not None:
                requested = request.max_completion_tokens or request.__dict__.get("max_tokens")
                if not isinstance(requested, int) or requested < 1:
                    raise GatewayError(400, f"max_tokens must be a positive integer, got {requested!r}",
                                       param="max_tokens")
            stop = tuple([request.stop] if isinstance(request.stop, str) else (request.stop or []))
            if body.get("model") in self.side_models:  # answered on its own prompt; the episode's row is untouched
                return self._side_completion(session, body, request, messages, tools, requested, stop)
            try:
                prompt_ids, extends = self.renderer.prompt(session.transcript, messages, tools, session.history_ids)
            except Exception as err:  # noqa: BLE001 - a template that cannot render these messages
                raise _unrenderable(err) from err
            overhead = time.monotonic() - start
            result = ep.sample_ids(prompt_ids, extends, requested, stop)
            start = time.monotonic()
            if result == "context_full":  # the runner ended the episode
                raise _context_exceeded(ep.max_model_len, len(prompt_ids))
            if isinstance(result, str):
                raise GatewayError(400, f"the episode has ended ({result}): no more completions are served for it",
                                   code="episode_ended")
            reply = self._reply(result, request, tools)
            session.history_ids = prompt_ids + result.token_ids
            session.transcript = Transcript([*messages, normalize_messages([reply["message"]])[0]], tools,
                                            session.transcript.calls + 1)
            self.calls += 1
            self.overhead_s += overhead + time.monotonic() - start
        return self._completion(body.get("model") or ep.model_name, reply, len(prompt_ids), len(result.token_ids))

    @staticmethod
    def _completion(model: str, reply: dict, prompt_tokens: int, completion_tokens: int) -> dict:
        """The chat-completions response for ``reply`` (:meth:`_reply`'s message and finish reason)."""
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "message": reply["message"], "logprobs": None,
                                             "finish_reason": reply["finish_reason"]}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _side_completion(self, session: _Session, body: dict, request, messages: list[dict], tools,
                         requested: int | None, stop: tuple[str, ...]) -> dict:
        """A side model's completion (see ``side_models``): rendered whole, sampled, answered, counted.

        Raises:
            GatewayError: the template cannot render the messages, the prompt alone fills the context,
                or the episode has ended.
        """
        try:
            prompt_ids = self.renderer.ids(messages, tools)
        except Exception as err:  # noqa: BLE001 - a template that cannot render these messages
            raise _unrenderable(err) from err
        result = session.episode.sample_side(prompt_ids, requested, stop)
        if result == "context_full":  # this prompt alone; the episode goes on
            raise _context_exceeded(session.episode.max_model_len, len(prompt_ids))
        if isinstance(result, str):
            raise GatewayError(400, f"side call not served ({result})", code="episode_ended")
        self._side_call(session, "side_model")
        return self._completion(body["model"], self._reply(result, request, tools), len(prompt_ids),
                                len(result.token_ids))

    # -- Anthropic Messages (infra.rollout.wire_anthropic) ---------------------------------------
    def complete_messages(self, key: str, body: Any) -> dict:
        """Serve one Anthropic Messages request body for episode ``key`` through :meth:`complete`.

        Raises:
            GatewayError: as :meth:`complete`, or the body is not a valid Messages request.
        """
        from infra.rollout import wire_anthropic

        self._session(key)
        start = time.monotonic()
        chat = wire_anthropic.chat_body(body)
        if isinstance(body, dict) and body.get("thinking") is not None:
            self.overridden["thinking"] = self.overridden.get("thinking", 0) + 1
        translate_s = time.monotonic() - start
        response = self.complete(key, chat)
        start = time.monotonic()
        message = wire_anthropic.messages_response(response)
        self.overhead_s += translate_s + time.monotonic() - start  # the translation is the gateway's own time
        return message

    # -- OpenAI Responses (infra.rollout.wire_responses) ----------------------------------------
    def complete_responses(self, key: str, body: Any) -> dict:
        """Serve one Responses API request body for episode ``key`` through :meth:`complete`.

        ``previous_response_id`` continues a response of this episode (its messages and reply, kept until the
        episode closes).

        Raises:
            GatewayError: as :meth:`complete`, the body is not a valid Responses request, or
                ``previous_response_id`` names no response of this episode.
        """
        from infra.rollout import wire_responses

        session = self._session(key)
        start = time.monotonic()
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        history = None
        if previous:
            with session.lock:
                history = session.responses.get(previous)
            if history is None:
                raise GatewayError(400, f"Previous response with id '{previous}' not found (a response of this "
                                   "episode is kept until the episode ends)", param="previous_response_id",
                                   code="previous_response_not_found")
        chat = wire_responses.chat_body(body, history)
        if body.get("reasoning") is not None:
            self.overridden["reasoning"] = self.overridden.get("reasoning", 0) + 1
        translate_s = time.monotonic() - start
        response = self.complete(key, chat)
        start = time.monotonic()
        result = wire_responses.response_object(response, body)
        with session.lock:
            session.responses[result["id"]] = [*chat["messages"], wire_responses.reply_message(response)]
        self.overhead_s += translate_s + time.monotonic() - start
        return result

    def count_tokens(self, key: str, body: Any) -> dict:
        """Anthropic's ``count_tokens``: the prompt ids the request would render to; nothing is sampled or recorded.

        Raises:
            GatewayError: unknown key, or the body is not a valid count_tokens request.
        """
        from infra.rollout import wire_anthropic

        session = self._session(key)
        chat = wire_anthropic.chat_body(body, count_only=True)
        prompt_ids = self.renderer.ids(normalize_messages(chat["messages"]), chat.get("tools"))
        self._side_call(session, "count_tokens")
        return {"input_tokens": len(prompt_ids)}

    def _parse(self, body: Any):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object with 'messages'", param="body")
        if not body.get("messages"):
            raise GatewayError(400, "'messages' is required: a non-empty list of chat messages", param="messages")
        from vllm.exceptions import VLLMValidationError

        try:
            request = ChatCompletionRequest.model_validate(body)
        except (VLLMValidationError, ValueError) as err:  # pydantic's ValidationError is a ValueError
            raise invalid_request(err) from err
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise GatewayError(400, f"unsupported parameter 'tool_choice'={body['tool_choice']!r}: forcing a tool "
                               "call constrains sampling, which the trainer cannot account for; serves 'auto' and "
                               "'none'", param="tool_choice", code="unsupported_parameter")
        for i, m in enumerate(body["messages"]):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") not in ("text", None)
                                               for p in parts):
                raise GatewayError(400, f"unsupported content in messages.{i}: only text parts are served "
                                   "(the policy is a text model)", param=f"messages.{i}.content",
                                   code="unsupported_parameter")
        for name, served in UNSUPPORTED.items():
            value = body.get(name, served)
            if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
                continue
            if value is not None and value != served and not (name.endswith("penalty") and value == 0):
                raise GatewayError(400, f"unsupported parameter '{name}'={value!r}: this endpoint samples for "
                                   f"training and serves only {name}={served!r}", param=name,
                                   code="unsupported_parameter")
        for name in ("temperature", "top_p", "top_k", "seed"):
            if body.get(name) is not None:
                self.overridden[name] = self.overridden.get(name, 0) + 1
        return request

    def _reply(self, sample: Sample, request, tools) -> dict:
        """The assistant message (content, tool calls by the model family's vLLM parser) and finish reason."""
        text = sample.text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if sample.stop_reason == "length" else "stop"
        if tools and self.tool_parser:
            from vllm.tool_parsers import ToolParserManager

            parser = ToolParserManager.get_tool_parser(self.tool_parser)(self.tokenizer, request.tools)
            info = parser.extract_tool_calls(text, request)
            if info.tools_called:
                message["content"] = info.content or None
                message["tool_calls"] = [{"id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                          "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                         for c in info.tool_calls]
                finish = "tool_calls"
        return {"message": message, "finish_reason": finish}

    # -- sandbox commands for out-of-process harnesses --------------------------------------
    def exec_command(self, key: str, body: Any) -> dict:
        """Run a command in episode ``key``'s sandbox (see the module docstring).

        Raises:
            GatewayError: unknown key, no ``command`` string, or the episode has ended.
        """
        session = self._session(key)
        if not isinstance(body, dict) or not isinstance(body.get("command"), str):
            raise GatewayError(400, "the body must be {\"command\": str, \"timeout_s\": number?, \"shell\": bool?}",
                               param="command")
        timeout = body.get("timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise GatewayError(400, f"timeout_s must be a positive number of seconds, got {timeout!r}",
                               param="timeout_s")
        shell = body.get("shell", True)
        if not isinstance(shell, bool):
            raise GatewayError(400, f"shell must be a boolean, got {shell!r}", param="shell")
        with session.lock:
            if session.closed:
                raise GatewayError(401, f"unknown episode key '{key[:40]}': the episode ended",
                                   "authentication_error", code="invalid_api_key")
            result = session.episode.exec_command(body["command"], float(timeout) if timeout else None, shell)
        if isinstance(result, str):
            raise GatewayError(409, f"the episode has ended ({result}): no more commands run in its sandbox",
                               code="episode_ended")
        return result

    # -- the server ---------------------------------------------------------------------------
    def _app(self):
        import anyio
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="agentrl gateway", docs_url=None, redoc_url=None)
        limiter: list = []

        async def run_in_threadpool(fn, *args):
            """A thread per call in flight (anyio's default pool of 40 would cap concurrent episodes)."""
            if not limiter:
                limiter.append(anyio.CapacityLimiter(4096))
            return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=limiter[0])

        def error(err: GatewayError):
            self.refused += 1
            return JSONResponse(err.body, status_code=err.status)

        async def body_of(request: Request):
            try:
                return json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise GatewayError(400, f"the request body is not valid JSON: {e}", param="body") from e

        def bearer(request: Request) -> str:
            auth = request.headers.get("authorization", "")
            return auth[7:].strip() if auth.lower().startswith("bearer ") else ""

        async def call(key: str, request: Request, serve, what: str, stream=None, error_body=lambda e: e.body):
            """One call: ``serve(key, body)`` in a thread, a refusal or a bug answered as ``error_body``.

            ``stream(response, body)`` gives the events when the body asks to stream.
            """
            try:
                body = await body_of(request)
                response = await run_in_threadpool(serve, key, body)
            except GatewayError as err:
                self.refused += 1
                return JSONResponse(error_body(err), status_code=err.status)
            except Exception as err:  # noqa: BLE001 - a gateway bug: a 500 the harness may retry, logged here
                log.exception("gateway: %s for %s failed", what, key)
                self._fail(key)
                self.refused += 1
                bug = GatewayError(500, f"internal error: {type(err).__name__}: {err}", "server_error")
                return JSONResponse(error_body(bug), status_code=500)
            if stream is not None and isinstance(body, dict) and body.get("stream"):
                return StreamingResponse(stream(response, body), media_type="text/event-stream")
            return JSONResponse(response)

        async def chat(key: str, request: Request):
            return await call(key, request, self.complete, "chat completion", lambda response, body: _sse_chunks(
                response, bool((body.get("stream_options") or {}).get("include_usage"))))

        async def responses(key: str, request: Request):
            from infra.rollout import wire_responses

            return await call(key, request, self.complete_responses, "responses call",
                              lambda response, _: wire_responses.sse_events(response))

        async def messages(key: str, request: Request):
            from infra.rollout import wire_anthropic

            return await call(key, request, self.complete_messages, "messages call",
                              lambda response, _: wire_anthropic.sse_events(response), wire_anthropic.error_body)

        async def count_tokens(key: str, request: Request):
            from infra.rollout import wire_anthropic

            return await call(key, request, self.count_tokens, "count_tokens call", None, wire_anthropic.error_body)

        async def models(key: str):
            try:
                s = self._session(key)
            except GatewayError as err:
                return error(err)
            self._side_call(s, "models")
            name = s.episode.model_name  # one list both SDKs read: OpenAI's fields and Anthropic's
            return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "agentrl",
                                                             "type": "model", "display_name": name,
                                                             "created_at": "1970-01-01T00:00:00Z"}],
                                 "has_more": False, "first_id": name, "last_id": name})

        async def exec_(key: str, request: Request):
            return await call(key, request, self.exec_command, "sandbox exec")

        app.post("/e/{key}/v1/chat/completions")(chat)
        app.post("/e/{key}/v1/messages")(messages)
        app.post("/e/{key}/v1/responses")(responses)
        app.post("/e/{key}/v1/messages/count_tokens")(count_tokens)
        app.get("/e/{key}/v1/models")(models)
        app.post("/e/{key}/sandbox/exec")(exec_)

        @app.post("/v1/chat/completions")
        async def chat_bearer(request: Request):
            return await chat(bearer(request), request)

        @app.post("/v1/responses")
        async def responses_bearer(request: Request):
            return await responses(bearer(request), request)

        @app.post("/v1/messages")
        async def messages_keyed(request: Request):  # Anthropic clients send x-api-key (or a bearer token)
            return await messages(request.headers.get("x-api-key") or bearer(request), request)

        @app.post("/v1/messages/count_tokens")
        async def count_tokens_keyed(request: Request):
            return await count_tokens(request.headers.get("x-api-key") or bearer(request), request)

        @app.get("/v1/models")
        async def models_bearer(request: Request):
            return await models(request.headers.get("x-api-key") or bearer(request))

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def not_served(path: str):
            return error(GatewayError(404, f"/{path} is not served: this gateway speaks OpenAI chat completions "
                                      "(POST .../v1/chat/completions), OpenAI Responses (POST .../v1/responses) and "
                                      "Anthropic Messages (POST .../v1/messages, .../v1/messages/count_tokens), and "
                                      "lists models (GET .../v1/models)", code="not_found"))

        return app

    def _start(self) -> None:
        import uvicorn

        # log_config=None: uvicorn's default runs logging.config.dictConfig, which shuts down every handler
        # already installed in this process (Prefect's API log handler among them) mid-run.
        config = uvicorn.Config(self._app(), log_config=None, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": self._sockets},
                                        name="agentrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.02)


def _sse_chunks(response: dict, include_usage: bool):
    """A complete response as OpenAI stream chunks (role, content, tool calls, finish, usage?, ``[DONE]``)."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    msg = response["choices"][0]["message"]

    def chunk(delta: dict, finish=None) -> str:
        c = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(c)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if msg.get("content"):
        yield chunk({"content": msg["content"]})
    for i, call in enumerate(msg.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"],
                                                  "arguments": call["function"]["arguments"]}}]})
    yield chunk({}, response["choices"][0]["finish_reason"])
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"
