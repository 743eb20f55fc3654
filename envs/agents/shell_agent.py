"""A minimal black-box agent: OpenAI chat completions with one `shell` tool, run inside a sandbox.

    python3 shell_agent.py --socket /gateway.sock --episode EP --task instruction.md [--max-turns 8]

It asks the policy (through the gateway's Unix socket: no network needed) for the next message, runs each
tool call's command with /bin/sh in the working directory, sends the output back as a `tool` message and
stops when the policy replies without a tool call or after --max-turns calls. It keeps the chat history as
the gateway returned it, so the episode stays one exact token sequence. Standard library only (it runs in
the sandbox's Python); the threat model is the sandbox's: everything it runs is the policy's choice.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys

SHELL = {"type": "function", "function": {
    "name": "shell", "description": "Run a shell command in the task's working directory; returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 600.0):
        super().__init__("gateway", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def complete(sock: str, episode: str, messages: list, max_tokens: int) -> dict:
    conn = UnixHTTPConnection(sock)
    body = json.dumps({"messages": messages, "tools": [SHELL], "max_tokens": max_tokens, "temperature": 1.0})
    conn.request("POST", f"/episodes/{episode}/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    if resp.status != 200:
        raise SystemExit(f"gateway answered {resp.status}: {data}")
    return data["choices"][0]["message"]


def run_tool(call: dict, timeout: float) -> str:
    try:
        command = json.loads(call["function"]["arguments"]).get("command", "")
        out = subprocess.run(["/bin/sh", "-c", str(command)], capture_output=True, text=True, timeout=timeout)
        text = f"exit code: {out.returncode}\n{out.stdout[-2000:]}{out.stderr[-1000:]}"
    except subprocess.TimeoutExpired:
        text = f"command timed out after {timeout} s"
    except (ValueError, KeyError, TypeError) as e:
        text = f"bad tool call: {e}"
    return f'<tool_response name="shell">\n{text}\n</tool_response>'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--episode", required=True)
    ap.add_argument("--task", required=True, help="file holding the task instruction")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tool-timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    messages = [{"role": "user", "content": open(args.task).read()}]
    for _ in range(args.max_turns):
        msg = complete(args.socket, args.episode, messages, args.max_tokens)
        messages.append({"role": "assistant", "content": msg["content"]})  # as returned: the episode stays exact
        if not msg.get("tool_calls"):
            break
        messages += [{"role": "tool", "content": run_tool(c, args.tool_timeout)} for c in msg["tool_calls"]]
    print(json.dumps({"turns": sum(m["role"] == "assistant" for m in messages)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
