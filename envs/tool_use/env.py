"""Tool-use environment: the model calls tools over several turns with
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` and ends with `<answer>...</answer>`.

Tools: `calculator` (arithmetic, evaluated by walking the parsed AST with size limits: no eval),
`list_files`, `read_file`, `write_file` (a per-episode workspace held in the worker), `run_python` (runs the
code in the sandbox with the workspace; files it writes come back). A malformed call, an unknown tool or
arguments that fail the tool's JSON schema get a <tool_error> observation; nothing the model writes raises.

Task payload: `answer`, optional `files` (initial workspace, path -> text), `rel_tol`.
Reward: `correct` (weight 1) the final answer matches; `format` (weight 0.1) one <answer>...</answer>.
"""
from __future__ import annotations

import ast
import math
import operator

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardSpec, Tool, ToolEnvironment, Workspace
from megatron_rl.envs.sandbox.base import Limits

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "log": math.log, "log10": math.log10, "exp": math.exp, "abs": abs, "round": round,
          "sin": math.sin, "cos": math.cos, "tan": math.tan, "floor": math.floor, "ceil": math.ceil,
          "min": min, "max": max}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_BITS = 4096


def _pow(a, b):
    if isinstance(a, int) and isinstance(b, int) and b > 0 and max(a.bit_length(), 1) * b > MAX_BITS:
        raise ValueError("result too large")
    if abs(b) > 10_000:
        raise ValueError("exponent too large")
    return operator.pow(a, b)


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _eval(node.left), _eval(node.right)
        out = _pow(a, b) if isinstance(node.op, ast.Pow) else _BIN[type(node.op)](a, b)
        if isinstance(out, int) and out.bit_length() > MAX_BITS:
            raise ValueError("result too large")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords and len(node.args) <= 8):
        return _FUNCS[node.func.id](*[_eval(a) for a in node.args])
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression safely (numbers, + - * / // % **, pi, e, sqrt/log/... functions)."""
    if len(expression) > 500:
        return "error: expression too long (limit 500 characters)"
    try:
        value = _eval(ast.parse(expression.replace("^", "**"), mode="eval"))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e.__class__.__name__}: {str(e)[:120]}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return repr(value) if isinstance(value, float) else str(value)


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TOOLS = (
    Tool("calculator", "Evaluate an arithmetic expression, e.g. '(3 + 4) * 2 ** 3' or 'sqrt(2) * pi'.",
         _obj({"expression": {"type": "string", "description": "the expression"}}, ["expression"])),
    Tool("list_files", "List the files in your workspace with their sizes.", _obj({}, [])),
    Tool("read_file", "Read a text file from your workspace.",
         _obj({"path": {"type": "string", "description": "relative path"}}, ["path"])),
    Tool("write_file", "Write (create or replace) a text file in your workspace.",
         _obj({"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"])),
    Tool("run_python", "Run Python 3 code in a sandbox whose working directory is your workspace (no network); "
         "returns the exit code, stdout and stderr. Files it writes stay in the workspace.",
         _obj({"code": {"type": "string", "description": "the program"}}, ["code"])),
)


@ENVIRONMENTS.register("tool_use")
class ToolUseEnv(ToolEnvironment):
    name = "tool_use"
    tools = TOOLS
    limits = Limits(wall_s=10.0, cpu_s=5.0, memory_mb=512)
    instructions = ("You can call tools by writing <tool_call>{\"name\": \"...\", \"arguments\": {...}}</tool_call>; "
                    "their results come back in the next message. When you know the answer, reply without a tool "
                    "call and put the final answer in <answer></answer> tags.")

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("correct", "answer_match", 1.0),
                           RewardComponent("format", "format", 0.1, {"kind": "answer_tag"})])

    def _start(self, task) -> None:
        self.workspace = Workspace()
        for path, content in (task.payload.get("files") or {}).items():
            self.workspace.write(path, content)

    def _reward_state(self) -> dict:
        return {"workspace": self.workspace}

    # ---- tools
    def tool_calculator(self, expression: str) -> str:
        return calculate(expression)

    def tool_list_files(self) -> str:
        files = self.workspace.files
        return "\n".join(f"{p}\t{len(b)} bytes" for p, b in sorted(files.items())) or "(empty workspace)"

    def tool_read_file(self, path: str) -> str:
        data = self.workspace.read(path)
        if data is None:
            return f"error: no such file {path!r}"
        return data.decode("utf-8", "replace")

    def tool_write_file(self, path: str, content: str) -> str:
        err = self.workspace.write(path, content)
        return f"error: {err}" if err else f"wrote {len(content.encode())} bytes to {path}"

    def tool_run_python(self, code: str) -> str:
        res, note = self.run_in_workspace("python3 .mrl_main.py", extra_files={".mrl_main.py": code})
        if res is None:
            return f"error: {note}"
        lines = [f"exit code: {res.exit_code}"]
        if res.stdout:
            lines.append(f"stdout:\n{res.stdout[-2000:]}")
        if res.stderr:
            lines.append(f"stderr:\n{res.stderr[-2000:]}")
        if note:
            lines.append(f"note: {note}")
        return "\n".join(lines)
