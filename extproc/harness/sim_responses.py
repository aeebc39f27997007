"""The simulated cluster's ``POST /v1/responses``: the OpenAI Responses API wire format.

What a real engine (vLLM's ``/v1/responses``) does, as far as routing can tell:

- a response object (``"object": "response"``) with a ``resp_`` id, ``output`` holding one
  assistant ``message`` of ``output_text``, ``status`` ``completed`` (or ``incomplete`` with
  ``incomplete_details.reason = "max_output_tokens"``) and ``usage`` with
  ``input_tokens_details.cached_tokens``;
- streamed, the typed SSE events ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` ..., ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed``, each
  with its ``sequence_number`` (no ``[DONE]`` terminator);
- ``store`` (default true): the response is kept in the serving process, and a later request
  naming it in ``previous_response_id`` is prefilled with the stored conversation (its prompt
  and output) before its own input. Another process does not have it: 404
  ``Response with id '...' not found.`` (vLLM's answer), which is why such turns must be
  routed to the engine that produced the response.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

# Characters of stored conversations one cluster keeps (oldest dropped first).
STORE_CHARS = 64 << 20


class ResponseStore:
    """Stored responses: id -> the conversation text so far (prompt + output), LRU-bounded by
    total characters."""

    def __init__(self, max_chars: int = STORE_CHARS) -> None:
        self.max_chars = max_chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._texts)

    def get(self, response_id: str) -> str | None:
        text = self._texts.get(response_id)
        if text is not None:
            self._texts.move_to_end(response_id)
        return text

    def put(self, response_id: str, text: str) -> None:
        old = self._texts.pop(response_id, None)
        if old is not None:
            self._chars -= len(old)
        self._texts[response_id] = text
        self._chars += len(text)
        while self._chars > self.max_chars and len(self._texts) > 1:
            _, dropped = self._texts.popitem(last=False)
            self._chars -= len(dropped)


class PreviousResponseMissing(LookupError):
    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def not_found_body(response_id: str) -> dict[str, object]:
    """vLLM's answer to a previous_response_id it does not hold (HTTP 404)."""
    return {
        "error": {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, object]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _message(item_id: str, text: str | None, status: str) -> dict[str, object]:
    content: list[object] = []
    if text is not None:
        content.append({"type": "output_text", "text": text, "annotations": []})
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response_object(
    response_id: str,
    request: Mapping[str, Any],
    created: int,
    *,
    text: str | None,
    truncated: bool,
    usage_doc: dict[str, object] | None,
    model: str,
) -> dict[str, object]:
    """The response object; ``text`` None: still in progress (no output yet)."""
    done = text is not None
    status = ("incomplete" if truncated else "completed") if done else "in_progress"
    item_id = "msg_" + response_id.removeprefix("resp_")
    output = [_message(item_id, text, "completed")] if done else []
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if done and truncated else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": None,
        "store": request.get("store", True) is not False,
        "temperature": request.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage_doc,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def _event(kind: str, payload: dict[str, object]) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"
    )


class ResponsesEvents:
    """The SSE events of one streamed response, in order, numbered."""

    def __init__(
        self, response_id: str, request: Mapping[str, Any], created: int, model: str
    ) -> None:
        self.response_id = response_id
        self.item_id = "msg_" + response_id.removeprefix("resp_")
        self._request = request
        self._created = created
        self._model = model
        self._seq = 0
        self.text = ""

    def _next(self, kind: str, payload: dict[str, object]) -> bytes:
        out = _event(kind, {**payload, "sequence_number": self._seq})
        self._seq += 1
        return out

    def _object(self, text: str | None, truncated: bool, usage_doc: object) -> dict[str, object]:
        return response_object(
            self.response_id,
            self._request,
            self._created,
            text=text,
            truncated=truncated,
            usage_doc=usage_doc if isinstance(usage_doc, dict) else None,
            model=self._model,
        )

    def opening(self, first: str) -> bytes:
        in_progress = self._object(None, False, None)
        part = {"type": "output_text", "text": "", "annotations": []}
        return (
            self._next("response.created", {"response": in_progress})
            + self._next("response.in_progress", {"response": in_progress})
            + self._next(
                "response.output_item.added",
                {"output_index": 0, "item": _message(self.item_id, None, "in_progress")},
            )
            + self._next(
                "response.content_part.added",
                {"item_id": self.item_id, "output_index": 0, "content_index": 0, "part": part},
            )
            + self.delta(first)
        )

    def delta(self, text: str) -> bytes:
        self.text += text
        return self._next(
            "response.output_text.delta",
            {
                "item_id": self.item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            },
        )

    def closing(self, truncated: bool, usage_doc: dict[str, object]) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return (
            self._next("response.output_text.done", {**where, "text": self.text, "logprobs": []})
            + self._next("response.content_part.done", {**where, "part": part})
            + self._next(
                "response.output_item.done",
                {"output_index": 0, "item": _message(self.item_id, self.text, "completed")},
            )
            + self._next(
                "response.completed", {"response": self._object(self.text, truncated, usage_doc)}
            )
        )
