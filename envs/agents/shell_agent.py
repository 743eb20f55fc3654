"""A minimal black-box agent: OpenAI chat completions with one `shell` tool, run inside a sandbox.

    python3 shell_agent.py --socket /gateway.sock [--episode EP] --task instruction.md|task.json [--max-turns 8]

It asks the policy (through the gateway's Unix socket: no network needed) for the next message, runs each
tool call's command with /bin/sh in the working directory, sends the output back as a `tool` message and
stops when the policy replies without a tool call, after --max-turns calls, or when the gateway refuses a
call (the episode's context budget is spent). It keeps the chat history as the gateway returned it, so the
episode stays one exact token sequence. `--task` is the instruction as text (the agent adds its shell tool),
or a JSON file {"messages": [...], "tools": [...]} used as the first call as it is. With --episode the calls
go to the rollout server's gateway routes (/episodes/EP/v1/...), with the episode's token from
$MEGATRON_RL_GATEWAY_TOKEN (`megatron_rl.rollout.gateway.episode_token`); without, to an episode's own socket.

Long histories (`--history`, against `--context-budget` tokens, measured from the gateway's `usage`):
- `full`: keep everything; a tool output keeps its last --max-output-chars characters (the gateway refuses
  the call that would pass the episode's budget: the episode ends, truncated);
- `head-tail`: a tool output longer than --max-output-chars keeps its head and tail (the episode stays exact);
- `drop-oldest`: head-tail, and when the last call's context plus the new output would pass the budget, the
  oldest exchanges (assistant message + its tool outputs) after the first message are dropped: the history
  is edited, so the gateway starts a new exact segment (what the model saw is what is recorded);
- `summary`: head-tail, and when the budget would be passed, the new outputs are sent with a request to the
  policy itself to summarise the work so far (that call still extends the episode exactly); the history then
  becomes the first message and that summary, and the gateway starts a new exact segment. Keep
  --context-budget below the episode's token budget by one output and a summary.

Standard library only (it runs in the sandbox's Python); the threat model is the sandbox's: everything it
runs is the policy's choice.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys

SHELL = {"type": "function", "function": {
    "name": "shell", "description": "Run a shell command in the task's working directory; returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
MAX_RAW = 1 << 16
"""Characters of a command's output read before the history strategy cuts it."""


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 900.0):
        super().__init__("gateway", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class Refused(Exception):
    """The gateway refused the call (the episode's budget is spent, or it ended)."""


def complete(sock: str, episode: str, messages: list, tools: list, max_tokens: int) -> tuple[dict, int]:
    """The policy's next message and the call's context size (prompt + completion tokens)."""
    conn = UnixHTTPConnection(sock)
    body = json.dumps({"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 1.0})
    path = f"/episodes/{episode}/v1/chat/completions" if episode else "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if os.environ.get("MEGATRON_RL_GATEWAY_TOKEN"):  # the gateway routes' episode token (never on argv)
        headers["Authorization"] = "Bearer " + os.environ["MEGATRON_RL_GATEWAY_TOKEN"]
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    if resp.status != 200:
        raise Refused(f"gateway answered {resp.status}: {str(data)[:300]}")
    usage = data.get("usage") or {}
    return data["choices"][0]["message"], int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))


def run_tool(call: dict, timeout: float) -> str:
    try:
        command = json.loads(call["function"]["arguments"]).get("command", "")
        out = subprocess.run(["/bin/sh", "-c", str(command)], capture_output=True, text=True, timeout=timeout,
                             errors="replace")
        text = f"exit code: {out.returncode}\n{out.stdout[-MAX_RAW:]}{out.stderr[-MAX_RAW // 4:]}"
    except subprocess.TimeoutExpired:
        text = f"command timed out after {timeout} s"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        text = f"bad tool call: {e}"
    return f'<tool_response name="shell">\n{text}\n</tool_response>'


def tail(text: str, limit: int) -> str:
    """The last `limit` characters of `text`, marked when cut."""
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n{text[-limit:]}"


def head_tail(text: str, limit: int) -> str:
    """`text` cut to its head and tail around a marker when longer than `limit` characters."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - head):]}"


def drop_oldest(messages: list, need: int, context: int, budget: int) -> list:
    """Drop whole exchanges after the first message, oldest first, until `context` minus the dropped part's
    estimate (4 characters a token) plus `need` fits `budget` (the last exchange is always kept)."""
    out = list(messages)
    while context + need > budget:
        starts = [i for i, m in enumerate(out) if i > 0 and m["role"] == "assistant"]
        if len(starts) < 2:
            break
        context -= sum(len(str(m.get("content", ""))) for m in out[starts[0]:starts[1]]) // 4 + 8
        out = out[:starts[0]] + out[starts[1]:]
    return out


SUMMARY_ASK = ("Your context is nearly full. Summarize the work so far for yourself in a few lines: what you found "
               "(exact values, file names), what you changed, and what is left to do. Reply with the summary only.")
"""The request of a summary (history strategy `summary`)."""


def summarized(sock: str, episode: str, messages: list, tools: list, max_tokens: int) -> tuple[list, int]:
    """The policy's summary of `messages` (asked in one more call that extends them), and the new history: the
    first message and the summary (as a user message)."""
    msg, context = complete(sock, episode, messages + [{"role": "user", "content": SUMMARY_ASK}], tools, max_tokens)
    note = {"role": "user", "content": f"Summary of your earlier steps, written by you:\n{msg['content']}\n"
                                       "Continue the task."}
    return [messages[0], note], context


def first_call(path: str) -> tuple[list, list]:
    """(messages, tools) of the first call: a JSON task as it is, or a text instruction with the shell tool."""
    text = open(path).read()
    if path.endswith(".json"):
        obj = json.loads(text)
        return list(obj["messages"]), list(obj.get("tools") or [SHELL])
    return [{"role": "user", "content": text}], [SHELL]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shell_agent.py")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--episode", default="")
    ap.add_argument("--task", required=True, help="the task instruction (text), or a JSON first call")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tool-timeout", type=float, default=30.0)
    ap.add_argument("--history", choices=("full", "head-tail", "drop-oldest", "summary"), default="full")
    ap.add_argument("--context-budget", type=int, default=0, help="tokens (drop-oldest, summary); 0 = no budget")
    ap.add_argument("--max-output-chars", type=int, default=2000,
                    help="a tool output's length at most (full: its tail; otherwise head and tail)")
    ap.add_argument("--quiet", action="store_true", help="no summary line on stdout")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    messages, tools = first_call(args.task)
    turns, context, stopped = 0, 0, "turns"
    cut = tail if args.history == "full" else head_tail
    for _ in range(args.max_turns):
        try:
            msg, context = complete(args.socket, args.episode, messages, tools, args.max_tokens)
        except Refused as e:
            stopped = str(e)[:200]
            break
        turns += 1
        messages.append({"role": "assistant", "content": msg["content"]})  # as returned: the episode stays exact
        if not msg.get("tool_calls"):
            stopped = "answer"
            break
        outs = [cut(run_tool(c, args.tool_timeout), args.max_output_chars) for c in msg["tool_calls"]]
        need = sum(map(len, outs)) // 4 + args.max_tokens + 16
        if args.history == "drop-oldest" and args.context_budget:
            messages = drop_oldest(messages, need, context, args.context_budget)
        messages += [{"role": "tool", "content": o} for o in outs]
        if args.history == "summary" and args.context_budget and context + need > args.context_budget:
            try:
                messages, context = summarized(args.socket, args.episode, messages, tools, args.max_tokens)
            except Refused as e:
                stopped = str(e)[:200]
                break
            turns += 1
    if not args.quiet:
        print(json.dumps({"turns": turns, "stopped": stopped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
