"""Deterministic prompt text, prompt canonicalisation and block hashing.

The simulated cluster and the replayer must agree on two things without talking to each other:
how a request body becomes the text a model would see (``canonical_prompt``), and how that text
is cut into KV blocks (``block_hashes``). Both live here so they cannot drift apart.

Tokens are approximated at 4 characters each, and a KV block is 512 tokens (2048 characters),
the block size of the Mooncake traces.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 512
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN

ApiKind = Literal["openai-chat", "openai-completions", "anthropic-messages", "openai-responses"]

API_PATHS: Mapping[ApiKind, str] = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "anthropic-messages": "/v1/messages",
    "openai-responses": "/v1/responses",
}

# Every word is at least 3 characters, so 512 words (plus separators) always fill a 2048-character
# block; the vocabulary only has to make blocks differ, not read well.
_VOCABULARY = """
    able about above accept across action active actual adapt adjust admit adopt advance advice
    affect after again agent agree ahead allow alone along alpha amount anchor angle answer
    apply arena argue around array arrive aspect asset assign assume atlas attach audit author
    avoid award backup badge balance band basic batch beacon begin below bench beta binary
    blend block board bonus border bounce branch brief bright broad bucket budget buffer build
    bundle cable cache canvas carbon carry cascade cause center chain change channel chapter
    charge check choice circle claim class clear client climb clock close cloud cluster coach
    code collect column combine comment commit common compare compile complex compute concept
    confirm connect consent context control convert copy core corner count course cover craft
    create credit cross crystal current cursor curve custom cycle daily damage data debug
    decade decide decode define degree delay delta demand depth deploy derive design detail
    detect device dialog digest direct domain double draft drive dynamic early echo edge effect
    effort element embed emerge enable encode energy engine enter entry equal error escape
    estimate event exact example exchange expand expect export extend factor falcon feature
    fetch field figure filter final finish first fleet focus follow format forward frame future
    gamma gateway gather general gentle global graph green ground group growth guard guide
    handle harbor header health height helix hidden history holder horizon hybrid ideal image
    impact import index infer input insert inside insight intent invoke island item journal
    kernel label ladder launch layer leader ledger legacy length level light limit linear
    listen local logic lookup machine margin marker master matrix medium memory merge method
    metric middle mirror mobile model module moment monitor motion native nearby network
    neutral night noble normal notice number object observe offset online option orbit order
    origin output owner packet panel parse partner patch path pattern pause peer phase pilot
    pivot planet plenty policy portal power prefix present prime probe process profile prompt
    proof proxy public pulse query queue quiet radius random range rapid ratio reach ready
    record reduce region relay remote render repair replica report request reserve resolve
    result retry review river robust route router sample scale schema scope screen search
    second secure select sense sequence series server session shadow shape share shift signal
    silver simple single sketch slice smooth socket solid source space spark split stable stack
    stage state steady stream strict string strong studio style submit summit supply switch
    symbol system table target task tempo tenant theory thread ticket timer token topic trace
    track traffic train transfer travel tree trigger tunnel update upper useful valid value
    vector verify version vessel view virtual vision visit volume water wave weight window
    winter worker yield zone
"""
_WORDS: tuple[str, ...] = tuple(_VOCABULARY.split())


class PromptError(ValueError):
    """The request body does not have the shape its API requires."""


def count_tokens(text: str) -> int:
    """Approximate token count: 4 characters per token, rounded up."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Chained hashes of the text's *full* blocks.

    Block i's hash covers the whole prefix up to and including block i (as vLLM's prefix cache
    does), so equal hashes imply equal prefixes and a cache lookup can stop at the first miss.
    A trailing partial block is not hashed: engines only reuse full blocks.
    """
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(
            parent + text[start : start + block_chars].encode(), digest_size=8
        ).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return tuple(hashes)


def _content_text(content: object, where: str) -> str:
    """Text of an OpenAI/Anthropic message content: a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise PromptError(f"{where}[{index}] must be an object")
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
            elif "content" in part:  # Anthropic tool_result carries nested content
                parts.append(_content_text(part["content"], f"{where}[{index}].content"))
            elif "input" in part:  # Anthropic tool_use: the arguments are prompt tokens too
                parts.append(repr(part["input"]))
        return "".join(parts)
    raise PromptError(f"{where} must be a string or a list of parts")


def _messages_text(messages: object, where: str) -> str:
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where} must be a non-empty list")
    out: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"{where}[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError(f"{where}[{index}].role must be a string")
        text = _content_text(message.get("content"), f"{where}[{index}].content")
        out.append(f"<|{role}|>{text}\n")
    return "".join(out)


def _tools_text(tools: object) -> str:
    """A tool catalogue is prompt text too (chat templates render it near the start): engines
    cache it with the rest of the prefix."""
    if not isinstance(tools, list) or not tools:
        return ""
    return "<|tools|>" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n"


def _responses_items_text(items: object) -> str:
    """Responses API ``input``: a string (one user message) or a list of items: messages
    (role + content of input_text / output_text parts, or a string) and items without a role
    (function_call, function_call_output, ...) whose fields are prompt tokens too."""
    if isinstance(items, str):
        return f"<|user|>{items}\n"
    if not isinstance(items, list) or not items:
        raise PromptError("input must be a string or a non-empty list")
    out: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise PromptError(f"input[{index}] must be an object")
        role = item.get("role")
        if isinstance(role, str):
            text = _content_text(item.get("content"), f"input[{index}].content")
            out.append(f"<|{role}|>{text}\n")
            continue
        kind = item.get("type")
        if not isinstance(kind, str):
            raise PromptError(f"input[{index}] needs a role or a type")
        fields = {k: v for k, v in item.items() if k not in ("id", "status")}
        out.append(f"<|{kind}|>" + json.dumps(fields, sort_keys=True, separators=(",", ":")))
        out.append("\n")
    return "".join(out)


def responses_prompt(body: Mapping[str, Any], earlier: str = "") -> str:
    """A Responses API request's prompt; ``earlier``: the conversation so far when the request
    names a ``previous_response_id`` (the previous response's prompt and output, which the
    engine that stored it prepends)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise PromptError("instructions must be a string")
    head = f"<|system|>{instructions}\n" if instructions else ""
    # The instructions of a previous response are not carried over (the Responses API's
    # rule): a chained turn's own come after the conversation so far.
    return (
        earlier + head + _tools_text(body.get("tools")) + _responses_items_text(body.get("input"))
    )


def canonical_prompt(api: ApiKind, body: Mapping[str, Any]) -> str:
    """The text a model would prefill for this request.

    Appending messages to a conversation only ever appends to this text, so a later turn's
    canonical prompt starts with the earlier turn's: that is what makes prefix caching work.
    """
    if api == "openai-chat":
        return _tools_text(body.get("tools")) + _messages_text(body.get("messages"), "messages")
    if api == "openai-responses":
        return responses_prompt(body)
    if api == "openai-completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        raise PromptError("prompt must be a string or a list of strings")
    system = body.get("system")
    head = "" if system is None else f"<|system|>{_content_text(system, 'system')}\n"
    return head + _tools_text(body.get("tools")) + _messages_text(body.get("messages"), "messages")


class TextSynth:
    """Deterministic filler text: the same key always yields the same characters.

    Keys are seeded into their own ``random.Random`` (string seeds are hashed with SHA-512, so
    results do not depend on PYTHONHASHSEED). Block texts are memoised in a bounded LRU because
    a trace reuses the same blocks many times.
    """

    def __init__(self, seed: int = 0, cache_blocks: int = 4096) -> None:
        self._seed = seed
        self._cache_blocks = cache_blocks
        self._blocks: OrderedDict[int, str] = OrderedDict()

    def text(self, key: str, n_chars: int) -> str:
        """``n_chars`` characters of words drawn from a PRNG seeded by ``key``."""
        if n_chars <= 0:
            return ""
        rng = random.Random(f"{self._seed}:text:{key}")
        # Words average well over 4 characters with their separator, so this over-generates.
        words = rng.choices(_WORDS, k=n_chars // CHARS_PER_TOKEN + 1)
        return " ".join(words)[:n_chars]

    def block(self, block_id: int) -> str:
        """The 2048-character text of one trace block id."""
        cached = self._blocks.get(block_id)
        if cached is not None:
            self._blocks.move_to_end(block_id)
            return cached
        rng = random.Random(f"{self._seed}:block:{block_id}")
        text = " ".join(rng.choices(_WORDS, k=BLOCK_TOKENS))[:BLOCK_CHARS]
        self._blocks[block_id] = text
        if len(self._blocks) > self._cache_blocks:
            self._blocks.popitem(last=False)
        return text

    def trace_prompt(self, hash_ids: Sequence[int], input_length: int, filler_key: str = "") -> str:
        """Prompt for a trace request: one block text per id, cut to ``input_length`` tokens.

        Requests sharing a leading run of ids share exactly that many blocks of text. If a trace
        line carries fewer ids than its length needs, the rest is filler keyed by ``filler_key``
        (unique per request), so it is never mistaken for a shared prefix.
        """
        n_chars = input_length * CHARS_PER_TOKEN
        needed = math.ceil(n_chars / BLOCK_CHARS)
        text = "".join(self.block(block_id) for block_id in hash_ids[:needed])
        if len(text) < n_chars:
            text += self.text(f"filler:{filler_key}", n_chars - len(text))
        return text[:n_chars]
