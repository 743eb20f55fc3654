"""Multi-turn episodes through the RL loop's in-process path: the one episode loop (envs.episode), the chat
template's observation tokens, exact loss masks from the episode to the shard and the trainer's packing,
and infrastructure failures masked out of the statistics.

The generator here is a SCRIPTED ENGINE (a test double of RolloutEngine with the same add_request / step
interface): it answers each turn from a fixed script so that a 3-turn tool episode happens for certain.
Everything else is real: the tool_use environment and its tools, the tokenizer and its chat template,
`Rollouts`, the episode runner's thread pool, HDF5 shards and the trainer's packing.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_rl.envs.base import Task, make_env
from megatron_rl.rollout.engine import RequestOutput, SampleOutput

CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
BAD = '<tool_call>{"name": "calculator", "arguments": </tool_call>'  # malformed: an error observation
ANSWER = "<answer>42</answer>"
SCRIPT = [CALC, BAD, ANSWER]
TASK = Task("t-42", "tool_use", "What is 6 times 7? Use the calculator.", {"answer": "42"})


class ScriptedEngine:
    """Turn k of every episode answers SCRIPT[k] (k = the observations already in its context) + end of turn."""

    def __init__(self, tok, script=None):
        self.tok, self.pending, self.counters, self.version = tok, [], {"steps": 0}, 3
        self.script = script
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, prompt, params, request_id):
        self.pending.append((request_id, list(prompt), params))
        self.prompts[request_id] = list(prompt)
        return request_id

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self):
        self.counters["steps"] += 1
        outs, self.pending = [RequestOutput(rid, p, self._samples(p, sp)) for rid, p, sp in self.pending], []
        return outs

    def _samples(self, prompt, params):
        text = self.tok.decode(prompt)
        turn = text.count("<tool_response") + text.count("<tool_error")
        script = self.script or SCRIPT
        ids = self.tok.encode(script[min(turn, len(script) - 1)]) + [self.tok.stop_ids[-1]]
        lps = [-0.01 * (1 + k % 7) for k in range(len(ids))]
        return [SampleOutput(i, ids, lps, [self.version] * len(ids), "stop") for i in range(params.n)]


@pytest.fixture
def hf_tok(tmp_path):
    from megatron_rl.tokenizer import HFTokenizer
    from tests.hf_tiny import tiny_tokenizer

    tiny_tokenizer(tmp_path)
    return HFTokenizer(tmp_path)


def _rollouts(tok, runner, group_size=2, script=None):
    from megatron_rl.loop.config import RLLoopConfig
    from megatron_rl.loop.rollout import Rollouts
    from megatron_rl.prompts import prompt_ids

    cfg = RLLoopConfig(prompts_per_step=1, group_size=group_size, max_new_tokens=64, dynamic_sampling=False)
    return Rollouts(ScriptedEngine(tok, script), runner, tok, lambda t: prompt_ids(tok, t), cfg, seed=1,
                    max_tokens=4096)


def _runner(make=None):
    from megatron_rl.envs.sandbox import SandboxConfig
    from megatron_rl.loop.episodes import ThreadEpisodeRunner

    return ThreadEpisodeRunner(SandboxConfig(backend="subprocess"), 2, make_env=make)  # no sandbox run here


def _expected(tok, prompt):
    """The episode built independently: the env stepped by hand, observations rendered by the tokenizer."""
    env = make_env("tool_use")
    env.reset(TASK)
    tokens, mask = list(prompt), [0] * len(prompt)
    for text in SCRIPT:
        ids = tok.encode(text) + [tok.stop_ids[-1]]
        tokens, mask = tokens + ids, mask + [1] * len(ids)
        res = env.step(text)
        if res.done:
            return tokens, mask, res
        obs = tok.observation_ids(res.observation.role, res.observation.text, stopped=True)
        tokens, mask = tokens + obs, mask + [0] * len(obs)
    raise AssertionError("the scripted episode did not end")


def test_three_turn_tool_episode_keeps_its_loss_mask_through_shard_and_packing(hf_tok, tmp_path):
    from megatron_rl.data.shards import read_arrays, write_shard
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.trainer.packing import PackingConfig, check_samples, pack

    runner = _runner()
    try:
        rollouts = _rollouts(hf_tok, runner)
        sampler = DomainSampler({"tool_use": [TASK]}, seed=0)
        rollouts.submit(0, [TASK])
        groups, _ = rollouts.batch(0, sampler)
    finally:
        runner.close()
    (g,) = groups
    tokens, mask, res = _expected(hf_tok, g.prompt)
    assert g.turns == [3, 3] and [r[0] for r in g.rewards] == [res.reward] * 2 and res.reward > 1.0  # correct+format
    assert "<tool_response" in hf_tok.decode(tokens) and "not valid JSON" in hf_tok.decode(tokens)
    trajs = rollouts.trajectories(groups, "t")
    write_shard(tmp_path / "s.h5", trajs)
    cols = read_arrays(tmp_path / "s.h5")
    for i in range(2):
        s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
        assert cols.tokens[s:e].tolist() == tokens and cols.loss_mask[s:e].tolist() == mask
        assert sum(mask) == 3 * 0 + sum(len(hf_tok.encode(t)) + 1 for t in SCRIPT)  # model tokens only
    keep, _ = check_samples(cols, 512, PackingConfig(max_tokens=4096))
    mbs, _ = pack(cols, keep, PackingConfig(max_tokens=4096), 0, 1)
    for i in range(2):
        (mb,) = [mb for mb in mbs if (mb["sample_index"][0] == i).any()]
        slots = (mb["sample_index"][0] == i).nonzero().flatten()
        assert mb["loss_mask"][0][slots].tolist() == [float(m) for m in mask[1:]]  # label side: token t+1's mask
    np.testing.assert_allclose(cols.logprobs[np.asarray(cols.loss_mask, bool)][:5],
                               [-0.01 * (1 + k % 7) for k in range(5)], rtol=1e-6)


def test_observation_tokens_are_the_chat_templates_own(hf_tok):
    """prompt + model turn + observation_ids decodes to the template's rendering of the whole conversation."""
    msgs = [{"role": "user", "content": "What is 7 + 5?"}]
    prompt = hf_tok.prompt_ids(msgs)
    turn = hf_tok.encode("12") + [hf_tok.stop_ids[-1]]
    obs = hf_tok.observation_ids("user", "Are you sure?", stopped=True)
    want = hf_tok.render(msgs + [{"role": "assistant", "content": "12"}, {"role": "user", "content": "Are you sure?"}])
    assert hf_tok._tok.decode(prompt + turn + obs, skip_special_tokens=False) == want
    cut = hf_tok.observation_ids("user", "Are you sure?", stopped=False)  # the model ran out of tokens
    assert hf_tok._tok.decode(hf_tok.encode("12") + cut, skip_special_tokens=False) == want[len(
        hf_tok._tok.decode(prompt, skip_special_tokens=False)):]


def test_tools_reach_a_template_that_does_not_render_them(tmp_path):
    from megatron_rl.tokenizer import HFTokenizer
    from tests.hf_tiny import tiny_tokenizer

    plain = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tiny_tokenizer(tmp_path, template=plain)
    tok = HFTokenizer(tmp_path)
    text = tok.decode(tok.prompt_ids([{"role": "user", "content": "hi"}], make_env("tool_use").tool_schemas()))
    assert not tok.template_renders_tools
    assert "<tools>" in text and '"name": "calculator"' in text and "<tool_call>" in text
    # a tool result is a user turn for such a template (it has no tool role)
    assert tok.decode(tok.observation_ids("tool", "R", stopped=True)).startswith("\nuser\nR")


class BrokenSandbox:
    name = "broken"

    def run(self, *a, **k):
        raise OSError("the sandbox host is gone")

    def close(self):
        pass


def test_infrastructure_failures_are_masked_and_counted_never_scored(hf_tok):
    """run_python on a sandbox that fails: status sandbox_error; dropped from training and from the reward
    statistics; <domain>/infra_error_frac is 1 (a case where it must be non-zero)."""
    from megatron_rl.envs.sampler import DomainSampler

    global SCRIPT
    saved, SCRIPT = SCRIPT, ['<tool_call>{"name": "run_python", "arguments": {"code": "print(42)"}}</tool_call>',
                             ANSWER, ANSWER]
    runner = _runner(lambda name, sb: make_env(name, sandbox=BrokenSandbox()))
    try:
        rollouts = _rollouts(hf_tok, runner)
        sampler = DomainSampler({"tool_use": [TASK]}, seed=0)
        rollouts.submit(0, [TASK])
        groups, stats = rollouts.batch(0, sampler)
    finally:
        SCRIPT = saved
        runner.close()
    assert groups == [] and stats["dropped_samples/sandbox_error"] == 2 == stats["dropped_samples"]
    m = sampler.metrics.summary()
    assert m["tool_use/infra_error_frac"] == 1.0 and m["tool_use/turns_mean"] == 2.0 and m["tool_use/count"] == 2


def test_engine_requests_of_follow_up_turns_carry_the_whole_context(hf_tok):
    from megatron_rl.rollout import SamplingParams

    runner = _runner()
    try:
        rollouts = _rollouts(hf_tok, runner, group_size=1)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=list(hf_tok.stop_ids))  # no seed
        (g,) = rollouts.run_now([TASK], [greedy], tag="e")
    finally:
        runner.close()
    prompts = rollouts.engine.prompts
    follow = sorted(k for k in prompts if "/t" in k)
    assert follow == ["e-0/s0/t1", "e-0/s0/t2"]
    full = g.prompt + list(g.samples[0].token_ids)
    for rid in follow:  # each turn's context is a prefix of the final sequence (never re-tokenised)
        assert full[:len(prompts[rid])] == prompts[rid]
    assert list(itertools.accumulate(g.masks[0]))[-1] == sum(g.masks[0]) > 0


def test_dispatched_episodes_keep_their_loss_mask_when_the_loop_repacks_them(tmp_path, hf_tok):
    """A 3-turn episode published by a rollout worker: the loop's re-pack (read_episodes -> Group ->
    trajectory) keeps its observation tokens at loss_mask 0, token for token; truncated is trained."""
    from megatron_rl.data.shards import Trajectory, write_shard
    from megatron_rl.loop.config import EpisodesConfig, RLLoopConfig
    from megatron_rl.loop.dispatched import DispatchRollouts, episode_id
    from megatron_rl.loop.rollout import Group

    prompt = [1, 5, 6, 7]
    tokens, mask = _expected(hf_tok, prompt)[:2]
    n = len(tokens)
    trajs = [Trajectory(tokens=np.asarray(tokens, np.int32), logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
                        loss_mask=np.asarray(mask, np.uint8), prompt_len=len(prompt), reward=1.1, group_id=0,
                        policy_version_first=0, policy_version_last=0, env="tool_use", task_id=TASK.id,
                        episode_id=episode_id(0, i), status=["ok", "truncated"][i], timings={"turns": 3.0},
                        token_versions=np.zeros(n, np.int32)) for i in range(2)]
    write_shard(tmp_path / "a.h5", trajs)
    rollouts = DispatchRollouts(None, None, hf_tok, lambda t: prompt, RLLoopConfig(group_size=2), 1, EpisodesConfig(),
                                None, tmp_path, None)
    out = rollouts._dispatch([Group(0, 0, TASK, prompt)], tmp_path, url="http://unused")
    g = Group(0, 0, TASK, prompt)
    rollouts._fill([g], out["episodes"])
    assert g.turns == [3, 3] and [r[2] for r in g.rewards] == ["ok", "ok"]
    for t in rollouts.trajectories([g], "x"):
        assert t.tokens.tolist() == tokens and t.loss_mask.tolist() == mask and 0 in mask[len(prompt):]


@pytest.mark.parametrize("solve", [True, False])
def test_terminal_tasks_are_evaluated_by_their_verifier(hf_tok, solve):
    """eval through the episode loop on a multi-turn domain: the reference commands as a shell tool call pass
    the hidden verifier (pass@k 1), doing nothing fails it (0); turns are counted."""
    import json

    from megatron_rl.envs.sandbox import SandboxConfig
    from megatron_rl.envs.tasks import load_domain
    from megatron_rl.loop.episodes import ThreadEpisodeRunner
    from megatron_rl.loop.evaluation import heldout_success
    from megatron_rl.run_config import RunConfig

    task = next(t for t in load_domain("terminal", split="train") if t.id == "terminal-fix-median")
    call = json.dumps({"name": "shell", "arguments": {"command": task.payload["reference_commands"][0]}})
    script = [f"<tool_call>{call}</tool_call>" if solve else "I give up.", "Done."]
    runner = ThreadEpisodeRunner(SandboxConfig(), 2)
    try:
        rollouts = _rollouts(hf_tok, runner, script=script)
        cfg = RunConfig()
        cfg.eval.k, cfg.rl.max_new_tokens = 2, 256
        m = heldout_success(rollouts, [task], cfg, tag="ev")
    finally:
        runner.close()
    want = 1.0 if solve else 0.0
    assert m["terminal/success_greedy"] == m["terminal/pass@1"] == m["terminal/pass@2"] == want, m
    assert m["terminal/turns_mean"] == (2.0 if solve else 1.0) and m["infra_error_frac"] == 0.0
