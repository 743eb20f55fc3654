"""Uneven pipeline stages (megatron_rl/stages.py, parallel.first/last_stage_layers, parallel.pipeline_layout):
validation accepts what Megatron-Core builds and refuses the rest with the reason and a working proposal, and
the layers per chunk and their global ids are the ones Megatron-Core itself computes."""
from __future__ import annotations

import pytest

from megatron_rl import config as C
from megatron_rl import stages
from megatron_rl.config import ConfigError
from megatron_rl.models.gpt import ModelConfig
from megatron_rl.parallel import ParallelConfig

DSV3 = "Et|(tt|)*30mL"


def test_parse_and_format_round_trip():
    assert stages.parse_layout(DSV3) == ["Et"] + ["tt"] * 30 + ["mL"]
    assert stages.parse_layout("Et*3|(tt|)*2,m|L") == ["Ettt", "tt", "tt", "m", "L"]
    for layout in (DSV3, "Ettt|ttL", "E|tt|tt|tL", "Et|||tL"):
        assert stages.format_layout(stages.parse_layout(layout)) == layout or \
            stages.parse_layout(stages.format_layout(stages.parse_layout(layout))) == stages.parse_layout(layout)
    assert stages.format_layout(["Et"] + ["tt"] * 30 + ["mL"]) == DSV3


@pytest.mark.parametrize("kw, msg", [
    (dict(pipeline_layout="Et|tL"), r"need parallel.pp > 1"),
    (dict(pp=2, first_stage_layers=0), r"first_stage_layers must be >= 1"),
    (dict(pp=2, first_stage_layers=1, pipeline_layout="Et|tL"), r"unset parallel.first_stage_layers"),
    (dict(pp=2, pipeline_layout="Et|t|tL"), r"has 3 stages; parallel.pp \* vpp = 2 \* 1 = 2"),
    (dict(pp=2, pipeline_layout="tE|tL"), r"stage 0 'tE' is not in the order"),
    (dict(pp=2, pipeline_layout="t|EtL"), r"'E' must appear once, at the start of the first stage"),
    (dict(pp=2, pipeline_layout="EtL|t"), r"'L' must appear once, at the end of the last stage"),
    (dict(pp=2, pipeline_layout="Etm|tL"), r"MTP layers 'm' go on the last stage"),
    (dict(pp=2, pipeline_layout="Ex|tL"), r"unknown characters \['x'\]"),
])
def test_structural_refusals_name_the_rule(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        C.from_dict(ParallelConfig, kw)


def _model(layers: int, mtp: int = 0) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, mtp_num_layers=mtp)


@pytest.mark.parametrize("kw, layers, mtp, chunks", [
    (dict(pp=2, first_stage_layers=2), 5, 0, [[2], [3]]),
    (dict(pp=3, first_stage_layers=1, last_stage_layers=2), 7, 0, [[1], [4], [2]]),
    (dict(pp=4, last_stage_layers=1), 10, 0, [[3], [3], [3], [1]]),
    (dict(pp=2, vpp=2, first_stage_layers=2), 6, 0, [[1, 1], [2, 2]]),
    (dict(pp=2, vpp=2, pipeline_layout="Et|tt|tt|mL"), 5, 1, [[1, 2], [2, 0]]),
    (dict(pp=8, vpp=4, pipeline_layout=DSV3), 61, 1, [[1, 2, 2, 2]] + [[2] * 4] * 6 + [[2, 2, 2, 0]]),
    (dict(pp=2, vpp=2), 8, 0, [[2, 2], [2, 2]]),
])
def test_accepted_splits_and_their_chunks(kw, layers, mtp, chunks):
    par = C.from_dict(ParallelConfig, kw)
    _model(layers, mtp).check_parallel(par)
    assert par.chunk_layers(layers) == chunks
    assert sum(map(sum, chunks)) == layers


@pytest.mark.parametrize("kw, layers, mtp, why", [
    (dict(pp=8, vpp=4), 61, 1, r"model.num_layers=61 is not divisible by parallel.pp\*vpp = 32"),
    (dict(pp=2, vpp=2, first_stage_layers=3), 5, 0, r"each must be a multiple of parallel.vpp=2"),
    (dict(pp=4, first_stage_layers=2, last_stage_layers=2), 7, 0, r"leave 3 layers, which do not split into 2"),
    (dict(pp=3, first_stage_layers=4, last_stage_layers=4), 7, 0, r"leave -1 of model.num_layers=7 layers"),
    (dict(pp=2, first_stage_layers=2, last_stage_layers=2), 5, 0, r"leave 1 of model.num_layers=5 layers for the 0"),
    (dict(pp=3, vpp=2, first_stage_layers=2), 8, 0, r"do not split into 2 other pipeline ranks x vpp=2"),
    (dict(pp=2, pipeline_layout="Ett|tL"), 4, 0, r"places 3 transformer layers 't'; model.num_layers=4"),
    (dict(pp=2, pipeline_layout="Ett|tL"), 3, 1, r"places 0 MTP layers 'm'; model.mtp_num_layers=1"),
])
def test_refusals_give_the_reason_and_a_proposal_that_is_accepted(kw, layers, mtp, why):
    par = C.from_dict(ParallelConfig, kw)
    with pytest.raises(ConfigError, match=why) as err:
        _model(layers, mtp).check_parallel(par)
    proposal = str(err.value).split("parallel.pipeline_layout: ")[1].split("'")[1]
    fixed = ParallelConfig(pp=par.pp, vpp=par.vpp, pipeline_layout=proposal)
    fixed.validate()
    _model(layers, mtp).check_parallel(fixed)


def test_deepseek_v3_proposal_is_megatrons_published_layout():
    assert stages.propose(61, 1, 8, 4) == DSV3
    with pytest.raises(ConfigError, match=r"pipeline_layout: 'Et\|\(tt\|\)\*30mL'"):
        _model(61, 1).check_parallel(ParallelConfig(pp=8, vpp=4))


def test_proposals_are_accepted_for_many_shapes():
    for layers in range(1, 40):
        for mtp in (0, 1, 2):
            for pp, vpp in ((2, 1), (3, 1), (2, 2), (4, 2), (3, 3)):
                layout = stages.propose(layers, mtp, pp, vpp)
                stages.check(layers, mtp, pp, vpp, layout=layout)


def _megatron_chunks(par: ParallelConfig, layers: int, mtp: int) -> tuple[list, list]:
    """(layers per chunk, first global layer id per chunk) as Megatron-Core computes them."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = par.vpp if par.vpp and par.vpp > 1 else None
    tc = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4,
                           pipeline_model_parallel_size=par.pp, virtual_pipeline_model_parallel_size=vpp,
                           pipeline_dtype=torch.float32,
                           mtp_num_layers=mtp or None, **par.transformer_kwargs())
    counts, offsets = [], []
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        for r in range(par.pp):
            ps.set_pipeline_model_parallel_rank(r)  # a layout reads the global rank
            v_range = range(vpp or 1)
            counts.append([get_num_layers_to_build(tc, vp_stage=v if vpp else None, pp_rank=r) for v in v_range])
            offsets.append([get_transformer_layer_offset(tc, vp_stage=v if vpp else None, pp_rank=r) for v in v_range])
    finally:
        ps.set_pipeline_model_parallel_rank(None)
        ps.set_virtual_pipeline_model_parallel_world_size(None)
    return counts, offsets


@pytest.mark.parametrize("kw, layers, mtp", [
    (dict(pp=2, first_stage_layers=2), 5, 0),
    (dict(pp=3, first_stage_layers=1, last_stage_layers=2), 7, 0),
    (dict(pp=4, last_stage_layers=1), 10, 0),
    (dict(pp=2, vpp=2, first_stage_layers=2), 6, 0),
    (dict(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=4), 12, 0),
    (dict(pp=2, vpp=2, pipeline_layout="Et|tt|tt|mL"), 5, 1),
    (dict(pp=8, vpp=4, pipeline_layout=DSV3), 61, 1),
    (dict(pp=2, vpp=2), 8, 0),
])
def test_chunks_and_layer_ids_are_megatrons(kw, layers, mtp):
    par = C.from_dict(ParallelConfig, kw)
    _model(layers, mtp).check_parallel(par)
    counts, offsets = _megatron_chunks(par, layers, mtp)
    assert par.chunk_layers(layers) == counts
    assert [[par.layer_offset(layers, r, v) for v in range(par.vpp or 1)] for r in range(par.pp)] == offsets


DSV3_HF = {  # DeepSeek-V3's published config.json (the fields the converter reads)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False}


def test_deepseek_v3_published_layout_passes_train_validation():
    """`megatron-rl train`'s validation (RunConfig.validate, before any rank starts) of DeepSeek-V3 as model.init
    resolves it from its config.json, at TP2 x PP8 x VPP4 x EP64 (1,024 ranks): accepted with Megatron's layout
    'Et|(tt|)*30mL'; without it refused (61 layers, 32 chunks) with that layout proposed."""
    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.run_config import RunConfig

    run = RunConfig()
    run.model, _ = for_hf_config(DSV3_HF).model_config(DSV3_HF)
    assert (run.model.num_layers, run.model.mtp_num_layers) == (61, 1)
    run.launch.nproc_per_node = 1024
    base = dict(tp=2, pp=8, vpp=4, ep=64, etp=1, sequence_parallel=True)
    run.parallel = C.from_dict(ParallelConfig, {**base, "pipeline_layout": DSV3}, prefix="parallel")
    run.validate()
    run.parallel = C.from_dict(ParallelConfig, base, prefix="parallel")
    with pytest.raises(ConfigError, match=r"num_layers=61 is not divisible by parallel.pp\*vpp = 32") as err:
        run.validate()
    assert f"parallel.pipeline_layout: '{DSV3}'" in str(err.value)
