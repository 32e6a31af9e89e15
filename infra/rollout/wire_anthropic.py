"""Anthropic's Messages API on the gateway: a request becomes a chat-completions body, a reply a Messages response.

Translation only, so one renderer, one extension/segment rule and one token-exact record
(:mod:`infra.rollout.gateway`) serve every wire format. The request side is vLLM's own conversion, as its
``/v1/messages`` server does it (``vllm.entrypoints.anthropic``: the request models and
``AnthropicServingMessages.to_chat_completion_request``): ``system`` becomes the first message (Claude Code's
per-request ``x-anthropic-billing-header`` line dropped, as vLLM drops it), ``tool_use`` blocks become tool
calls with JSON arguments, ``tool_result`` blocks ``tool`` messages, ``tools[].input_schema`` the functions'
parameters, ``stop_sequences`` ``stop``. ``thinking`` is accepted and has no effect (the policy has no
thinking budget; counted as overridden). The reply side follows Anthropic's reference
(https://docs.anthropic.com/en/api/messages, /en/api/messages-streaming): text and ``tool_use`` content
blocks, ``stop_reason`` ``end_turn`` | ``max_tokens`` | ``tool_use`` (a stop string also reads ``end_turn``:
the engine's sample does not say which string matched), ``usage``, and for ``stream`` the event sequence
``message_start``, per block ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
``message_stop``. Errors are ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from infra.rollout.gateway_errors import GatewayError, invalid_request

IGNORED = ("reasoning_effort", "thinking_token_budget")
"""Fields vLLM's conversion derives from ``thinking`` that the gateway does not serve (dropped, counted)."""
_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                "server_error": "api_error"}


def _validated(model, body: Any):
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object with 'model', 'messages' and "
                           "'max_tokens' (Anthropic Messages API)", param="body")
    try:
        return model.model_validate(body)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise invalid_request(err) from err


def chat_body(body: Any, count_only: bool = False) -> dict:
    """The chat-completions body of an Anthropic Messages (``count_only``: count_tokens) request body.

    Raises:
        GatewayError: 400, the body is not a valid Messages request (the field is named).
    """
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    request = _validated(AnthropicCountTokensRequest if count_only else AnthropicMessagesRequest, body)
    try:
        chat = AnthropicServingMessages.to_chat_completion_request(request)
    except ValueError as err:  # e.g. a tool_removal naming an undeclared tool
        raise invalid_request(err) from err
    out = chat.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    for name in (*IGNORED, "stream", "stream_options", "parallel_tool_calls"):
        out.pop(name, None)
    return out


def messages_response(chat: dict) -> dict:
    """The Messages response for the gateway's chat-completions response ``chat``.

    Raises:
        GatewayError: 500, a parsed tool call's arguments are not a JSON object (a ``tool_use`` input must be
            one; vLLM's server fails such a reply too).
    """
    choice = chat["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    content: list[dict] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"] or "{}")
        if not isinstance(arguments, dict):
            raise GatewayError(500, f"the policy's call of tool {call['function']['name']!r} has arguments that "
                               f"are not a JSON object ({type(arguments).__name__}): not a tool_use input",
                               "server_error")
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    stop = {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish, "end_turn")
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content or [{"type": "text", "text": ""}],
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": chat["usage"]["prompt_tokens"],
                      "output_tokens": chat["usage"]["completion_tokens"]}}


def sse_events(response: dict) -> Iterator[str]:
    """A complete Messages response as Anthropic's stream events (one delta per block)."""
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    usage = response["usage"]
    yield event("message_start", {"message": {**response, "content": [], "stop_reason": None,
                                              "usage": {**usage, "output_tokens": 0}}})
    for i, block in enumerate(response["content"]):
        if block["type"] == "text":
            yield event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_delta", {"index": i, "delta": delta})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": response["stop_reason"], "stop_sequence": None},
                                  "usage": {"output_tokens": usage["output_tokens"]}})
    yield event("message_stop", {})


def error_body(err: GatewayError) -> dict:
    """``err`` (an OpenAI-style body) as Anthropic's error body."""
    inner = err.body["error"]
    kind = "not_found_error" if inner.get("code") == "not_found" else _ERROR_TYPES.get(inner["type"],
                                                                                       "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": inner["message"]}}
