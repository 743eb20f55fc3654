"""The prompt of a task as token ids: the model's chat template when its tokenizer has one, else the compact
text format of tiny byte-level models. Every component that prompts the policy (warm-up, the RL loop, eval,
rollout workers) goes through `prompt_ids`, so a task is tokenised the same way everywhere."""
from __future__ import annotations

from functools import cache


def compact_prompt(task) -> str:
    """A short prompt for tiny byte-level models: the environment's own (`Environment.compact_prompt`)."""
    return environment(task.domain).compact_prompt(task)


@cache
def environment(domain: str):
    """A default instance of the domain's environment (its prompt format, tools and success definition)."""
    import megatron_rl.envs  # noqa: F401  (registers the built-in environments)
    from megatron_rl.envs.base import make_env

    return make_env(domain)


def messages(task) -> list[dict]:
    """The chat of a task: one user turn with the environment's rendered prompt (its format instructions)."""
    return [{"role": "user", "content": environment(task.domain).render_prompt(task)}]


def prompt_ids(tok, task) -> list[int]:
    """Token ids the policy is prompted with for `task`, ending where its answer starts."""
    if tok.has_chat_template:
        return tok.prompt_ids(messages(task), environment(task.domain).tool_schemas() or None)
    return tok.prompt_ids([{"role": "user", "content": compact_prompt(task)}])
