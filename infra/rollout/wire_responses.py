"""OpenAI's Responses API on the gateway: a request becomes a chat-completions body, a reply a Response.

Translation only, as :mod:`infra.rollout.wire_anthropic`: one renderer, one extension rule and one
token-exact record serve every format. The request side is vLLM's own conversion, as its ``/v1/responses``
server does it (``vllm.entrypoints.openai.responses``: ``ResponsesRequest`` validation,
``construct_input_messages`` and ``construct_tool_dicts``): ``instructions`` becomes the system message,
``message`` items messages (``input_text``/``output_text`` parts as text), ``function_call`` items the
assistant's tool calls, ``function_call_output`` items ``tool`` messages, ``function`` tools the chat tools
(other tool types are left out, as vLLM leaves them out), ``max_output_tokens`` ``max_tokens``.
``previous_response_id`` names a response of the same episode: its messages and reply come first (kept per
episode, from the gateway's session; an unknown id is a 400 naming it, as OpenAI's API answers).
``reasoning`` is accepted and has no effect (counted as overridden). The reply side follows OpenAI's
reference (https://platform.openai.com/docs/api-reference/responses): ``message`` and ``function_call``
output items, ``status`` ``completed`` or ``incomplete`` (``max_output_tokens``), ``usage``; for ``stream``
the events ``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its
content or arguments deltas and dones, ``response.output_item.done``, then ``response.completed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from infra.rollout.gateway_errors import GatewayError, invalid_request

REFUSED = {"logit_bias": None, "top_logprobs": 0, "max_tool_calls": None, "background": False}
"""Request fields the trainer could not account for, with the only value served."""


def _text_parts(content: Any) -> Any:
    """Responses content parts (``input_text``, ``output_text``) as chat text parts.

    Other parts are kept, and the gateway refuses them (the policy is a text model).
    """
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": p.get("text", "")} if isinstance(p, dict) and p.get("type") in (
        "input_text", "output_text") else p for p in content]


def chat_body(body: Any, history: list[dict] | None) -> dict:
    """The chat-completions body of a Responses request ``body``.

    ``history``: the chat messages (reply included) of the response ``previous_response_id`` names.

    Raises:
        GatewayError: 400, the body is not a valid Responses request (the field is named), or asks for what the
            trainer cannot account for (``tool_choice`` other than auto/none, ``logit_bias``, structured output).
    """
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts
    from vllm.exceptions import VLLMValidationError

    if not isinstance(body, dict) or "input" not in body:
        raise GatewayError(400, "the request body must be a JSON object with 'input' (OpenAI Responses API)",
                           param="input")
    for name, served in REFUSED.items():
        if body.get(name, served) not in (served, None):
            raise GatewayError(400, f"unsupported parameter '{name}'={body[name]!r}: this endpoint samples for "
                               f"training and serves only {name}={served!r}", param=name,
                               code="unsupported_parameter")
    fmt = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
        raise GatewayError(400, f"unsupported parameter 'text.format.type'={fmt!r}: structured output constrains "
                           "sampling, which the trainer cannot account for; serves 'text'",
                           param="text.format", code="unsupported_parameter")
    try:
        request = ResponsesRequest.model_validate(body)
        messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input,
                                            prev_msg=history)
        tools = construct_tool_dicts(request.tools, request.tool_choice)
    except (VLLMValidationError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        raise invalid_request(err) from err
    choice = request.tool_choice if isinstance(request.tool_choice, str) else body.get("tool_choice")
    chat: dict[str, Any] = {"model": request.model or "", "tool_choice": choice,
                            "messages": [{**m, "content": _text_parts(m.get("content"))} for m in
                                         (dict(m) for m in messages)]}
    if tools and choice != "none":
        chat["tools"] = tools
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    return chat


def response_object(chat: dict, body: dict) -> dict:
    """The Response for the gateway's chat-completions response ``chat`` to the Responses request ``body``."""
    message = chat["choices"][0]["message"]
    output: list[dict] = []
    if message.get("content"):
        output.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]})
    truncated = chat["choices"][0]["finish_reason"] == "length"
    usage = chat["usage"]
    return {"id": "resp_" + chat["id"].removeprefix("chatcmpl-"), "object": "response", "created_at": time.time(),
            "status": "incomplete" if truncated else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "model": chat["model"], "output": output, "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "store": body.get("store", True),
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


def reply_message(chat: dict) -> dict:
    """The assistant's chat message of ``chat``, as a later ``previous_response_id`` request continues it."""
    message = chat["choices"][0]["message"]
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def sse_events(response: dict) -> Iterator[str]:
    """A complete Response as the Responses API's stream events (one delta per item), numbered."""
    seq = iter(range(1 << 30))

    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': next(seq), **data})}\n\n"

    pending = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", {"response": pending})
    yield event("response.in_progress", {"response": pending})
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress",
                                                                                     "content": []}})
            ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield event("response.content_part.added", {**ids, "part": {**part, "text": ""}})
            yield event("response.output_text.delta", {**ids, "delta": part["text"], "logprobs": []})
            yield event("response.output_text.done", {**ids, "text": part["text"], "logprobs": []})
            yield event("response.content_part.done", {**ids, "part": part})
        else:
            yield event("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress",
                                                                                     "arguments": ""}})
            ids = {"item_id": item["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", {**ids, "delta": item["arguments"]})
            yield event("response.function_call_arguments.done", {**ids, "name": item["name"],
                                                                   "arguments": item["arguments"]})
        yield event("response.output_item.done", {"output_index": i, "item": item})
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                {"response": response})
