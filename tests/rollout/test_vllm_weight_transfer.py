"""engine.vllm.weight_transfer=gloo|nccl: vLLM's weight-transfer API (init_weight_transfer_engine, then per update
start_weight_update / update_weights / finish_weight_update while the trainer broadcasts) driven by the vLLM
engine against the real vLLM worker (scripts/setup_vllm.sh's .venv-vllm; no mock) over a gloo group, the CPU twin
of the nccl route (same code but the group's backend): the metadata sent equals what the file route writes; greedy
tokens after an update equal transformers' on the new weights and the file route's on the same engine; versions,
a missing tensor, the abort policy; a killed process restarted that joins a new group and receives the last synced
tensors. nccl itself (CUDA) is refused here before any work, naming the setting; scripts/gpu_check_vllm.sh runs
this module with weight_transfer=nccl on GPUs (MRL_VLLM_WEIGHT_TRANSFER). One vLLM engine for the module (and one
restart of it): ~90 CPU-s in all, hence `slow` but for the refusals."""
import os
import signal
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import EngineConfig
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.vllm_config import VLLMConfig
from tests.hf_tiny import tiny_llama, tiny_tokenizer
from tests.rollout.test_vllm_backend import PROMPTS, SHAPE, VLLM_PY, _hf_greedy, _megatron_model

ROUTE = os.environ.get("MRL_VLLM_WEIGHT_TRANSFER", "gloo")
"""The route the engine tests drive: gloo on CPU; scripts/gpu_check_vllm.sh sets nccl on a GPU machine."""
VLLM_GPU = os.environ.get("MRL_VLLM_GPU", "")
"""engine.vllm.cuda_visible_devices of the module's engine (nccl: a GPU other than this process's)."""
needs_vllm = pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM environment: run `bash scripts/setup_vllm.sh` "
                                "(scripts/test.sh does) to build .venv-vllm")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(folder, tiny_tokenizer(folder), **SHAPE)
    return folder


@pytest.fixture(scope="module")
def engine(hf_dir, tmp_path_factory):
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    vcfg = VLLMConfig(python=str(VLLM_PY), weight_transfer=ROUTE, cuda_visible_devices=VLLM_GPU)
    eng = VLLMEngine(vcfg, EngineConfig(max_running=16),
                     f"hf:{hf_dir}", 1024, "float32", log_dir=tmp_path_factory.mktemp("vllm_log"))
    yield eng
    eng.close()
    assert not eng.shm.exists()


def _greedy(engine, n=10):
    return [o.samples[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                                    max_new_tokens=n))]


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() * (1 + 0.5 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()}


@pytest.mark.slow
def test_transfer_metadata_equals_what_the_file_route_writes(hf_dir, tmp_path):
    """The names, dtypes and shapes of update_weights (and the tensors broadcast) are the file route's safetensors,
    tensor for tensor (the converter's tables; a tied output layer in neither)."""
    from safetensors import safe_open

    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.convert.source import hf_config
    from megatron_rl.rollout.vllm_engine import write_hf
    from megatron_rl.rollout.vllm_transfer import hf_tensors, update_info

    hf = {**hf_config(f"hf:{hf_dir}"), "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    arch = for_hf_config(hf)
    named = list(_perturbed(_megatron_model(hf_dir), 1).items())
    tensors = hf_tensors(named, arch, hf)
    info = update_info(tensors)
    written = write_hf(named, arch, hf, tmp_path / "hf")
    assert sorted(info["names"]) == sorted(written) and len(info["names"]) == len(set(info["names"]))
    assert "lm_head.weight" not in written and "model.layers.1.self_attn.q_proj.weight" in written
    files = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as r:
            files.update({k: r.get_tensor(k) for k in r.keys()})
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
        assert (dtype, shape) == (str(files[name].dtype).removeprefix("torch."), list(files[name].shape)), name
        assert torch.equal(tensors[name], files[name]), name
    assert set(info["dtype_names"]) == {"bfloat16"}


def test_nccl_without_cuda_is_refused_before_any_work(hf_dir):
    """The refusal comes before the environment check (a python that does not exist is never looked at)."""
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: weight_transfer=nccl is not refused here")
    with pytest.raises(ConfigError, match=r"engine.vllm.weight_transfer=nccl needs CUDA GPUs.*"
                                          r"engine.vllm.weight_transfer=file.*gloo"):
        VLLMEngine(VLLMConfig(python="/nonexistent/bin/python", weight_transfer="nccl"), EngineConfig(),
                   f"hf:{hf_dir}", 256)
    with pytest.raises(ConfigError, match=r"weight_transfer='ipc' is not one of file, nccl, gloo"):
        VLLMConfig(weight_transfer="ipc").validate()


def test_nccl_with_vllm_on_the_trainers_gpu_is_refused(monkeypatch):
    """With CUDA (faked here: the only mock, for the GPU this machine lacks) nccl still needs vLLM on another GPU."""
    from megatron_rl.rollout.vllm_config import check_transfer_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"GPU other than the trainer rank's.*engine.vllm.cuda_visible_devices.*"
                                          r"weight_transfer=file"):
        check_transfer_device(VLLMConfig(weight_transfer="nccl"))
    check_transfer_device(VLLMConfig(weight_transfer="nccl", cuda_visible_devices="1"))


@needs_vllm
@pytest.mark.slow
def test_update_by_weight_transfer_equals_transformers_and_the_file_route(engine, hf_dir, tmp_path):
    """Trainer weights perturbed -> update_weights by the weight-transfer route: greedy tokens are transformers'
    on the new weights, nothing is written to tmpfs, a request across the update records both versions; a sync
    missing a tensor is refused naming it; on the same engine the file route's update to the same weights gives
    the same tokens (and the original weights the original ones)."""
    from megatron_rl.rollout.vllm_engine import write_hf

    model = _megatron_model(hf_dir)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _perturbed(model, 3)
    before = _greedy(engine)
    rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=10))
    for _ in range(4):
        engine.step()
    assert engine.update_weights(1, new.items()) > 0 and engine.version == 1
    assert [p.name for p in engine.shm.iterdir()] == ["tmp"]  # from memory: no weights folder (tmp: vLLM's TMPDIR)
    done = []
    while engine.has_work:
        done += engine.step()
    vs = next(o for o in done if o.request_id == rid).samples[0].policy_versions
    assert vs[0] == 0 and vs[-1] == 1 and vs == sorted(vs)
    after = _greedy(engine)
    ref_dir = tmp_path / "new_hf"
    write_hf(new.items(), engine.arch, engine.hf, ref_dir)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (ref_dir / f).write_bytes((hf_dir / f).read_bytes())
    assert after == [_hf_greedy(ref_dir, p, 10)[0] for p in PROMPTS] and after != before
    with pytest.raises(RuntimeError, match="unwritten.*model.norm.weight"):
        engine.update_weights(2, [(n, t) for n, t in new.items() if n != "decoder.final_layernorm.weight"])
    assert engine.version == 1
    engine.vcfg.weight_transfer = "file"  # the file route on the same process (its reload op needs no group)
    try:
        engine.update_weights(2, original.items())
        assert _greedy(engine) == before
        engine.update_weights(3, new.items())
        assert _greedy(engine) == after
    finally:
        engine.vcfg.weight_transfer = ROUTE
    engine.update_weights(4, original.items())  # and back by weight transfer
    assert _greedy(engine) == before


@needs_vllm
@pytest.mark.slow
def test_abort_policy_by_weight_transfer_ends_requests_in_flight(engine, hf_dir):
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=50, n=2, seed=1))
    engine.step()
    engine.update_weights(engine.version + 1, _megatron_model(hf_dir).named_parameters(), policy="abort")
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid] and {s.finish_reason for s in outs[0].samples} == {"abort"}
    assert not engine.has_work


@needs_vllm
@pytest.mark.slow
def test_restarted_process_joins_a_new_group_and_receives_the_last_synced_weights(engine, hf_dir):
    """Last in the module (it restarts the module's engine): a SIGKILLed vLLM process is seen at the next step,
    restarted; the new process joins a new transfer group at its start and gets the last synced tensors (the
    kept CPU copy) by it, so its greedy tokens are those of the synced weights, not the model folder's."""
    new = _perturbed(_megatron_model(hf_dir), 7)
    base = _greedy(engine)
    engine.update_weights(engine.version + 1, new.items())
    want = _greedy(engine)
    assert want != base
    pid, restarts = engine.proc.pid, engine.restarts
    os.killpg(pid, signal.SIGKILL)
    assert _greedy(engine) == want
    assert engine.proc.pid != pid and engine.restarts == restarts + 1
    log = Path(engine.log_path).read_text(errors="replace")
    assert log.count(f"joined the trainer's {ROUTE} weight-transfer group") == 2 + restarts
