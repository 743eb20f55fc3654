"""Document QA environment: single turn; a question over a document given in the prompt (small financial
statements). The model answers with a JSON object in <answer> tags: {"value": ..., "unit": ...,
"explanation": ...}.

Task payload: `question`, `reference` (reference answer text for the judge), `checks` (rule checks:
required fields, number with tolerance, unit among allowed spellings) and `rubric` (criteria for the judge).
Reward: `rules` the fraction of rule checks passed; `judge` the LLM judge's mean rubric score. With a judge
the weights are rules 0.8 and judge 0.2; without one (no endpoint configured) only `rules`, weight 1.
"""
from __future__ import annotations

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardSpec, SingleTurnEnvironment


@ENVIRONMENTS.register("docqa")
class DocQAEnv(SingleTurnEnvironment):
    name = "docqa"
    success_component = "rules"
    instructions = ("Answer with a JSON object inside <answer></answer> tags with the fields \"value\" (a number), "
                    "\"unit\" (e.g. \"USD millions\", \"%\" or \"x\") and \"explanation\" (the line items and the "
                    "calculation you used).")

    def reward_spec(self) -> RewardSpec:
        if self.judge is None:
            return RewardSpec([RewardComponent("rules", "rule_checks", 1.0)])
        return RewardSpec([RewardComponent("rules", "rule_checks", 0.8), RewardComponent("judge", "llm_judge", 0.2)])
