"""Tools the model may call: JSON-schema declarations and the parser of its `<tool_call>{json}</tool_call>` blocks
(never raises on what the model writes)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class Tool:
    """A tool the model may call; `parameters` is the JSON schema of its arguments object."""

    name: str
    """Name the model calls it by."""
    description: str
    """What it does (shown to the model)."""
    parameters: dict
    """JSON schema (an object schema) of its arguments."""

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One parsed `<tool_call>` block; `error` is set (and name/arguments empty) when it was malformed."""

    name: str
    """Tool name as the model wrote it."""
    arguments: dict
    """Arguments object as the model wrote it (validated later against the tool's schema)."""
    error: str | None = None
    """Why the block could not be parsed (shown to the model); None when it parsed."""


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        return ToolCall("", {}, f"tool call is not valid JSON ({e.__class__.__name__}: {str(e)[:120]})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call must be a JSON object {"name": "...", "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ToolCall("", {}, f"tool call {obj['name'][:80]!r}: 'arguments' must be a JSON object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Parse `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in order of appearance.

    Never raises: a malformed block becomes a ToolCall with `error` set (the message for the model).
    """
    calls = [_parse_one(raw) for raw in TOOL_CALL_RE.findall(text)]
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall("", {}, "unterminated <tool_call> (missing </tool_call>)"))
    return calls


def has_tool_call(text: str) -> bool:
    return "<tool_call>" in text
