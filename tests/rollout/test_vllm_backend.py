"""engine.backend=vllm against a real vLLM (scripts/setup_vllm.sh's .venv-vllm; no mock): greedy tokens equal to
transformers' on the same fp32 weights, sampled-token log-probs within a bound of transformers' log-softmax,
a weight sync (trainer names -> HF -> tmpfs -> reload_weights) that changes the outputs to the new weights'
and records the version per token, abort on update, bad input (a missing environment, another version, a model
vLLM cannot load), a killed or hung vLLM process restarted with no sample lost (and a clear error beyond
engine.vllm.max_restarts), the rollout server and gateway on it, the main job on fleet workers (killed
vLLM, bf16 mismatch corrected and alerted; one launch). One vLLM engine for the module (its start-up costs ~15-60 s on
this CPU); the tests that end or restart its process come last."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import EngineConfig
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.vllm_config import VLLMConfig, check_environment
from tests.hf_tiny import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MRL_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
"""The vLLM environment's python (scripts/gpu_check_vllm.sh points it at a CUDA build's)."""
pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM environment: run `bash scripts/setup_vllm.sh` "
                                "(scripts/test.sh does) to build .venv-vllm")
# head_dim 64 (vLLM's CPU attention has no 16); room for the main job's countdown prompts in the tiny tokenizer
SHAPE = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 1, "max_positions": 1024}
PROMPTS = [[5, 6, 7, 8], [40, 41, 9], [100, 3, 77, 12, 19, 2]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(folder, tiny_tokenizer(folder), **SHAPE)
    return folder


@pytest.fixture(scope="module")
def engine(hf_dir, tmp_path_factory):
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMConfig(python=str(VLLM_PY)), EngineConfig(max_running=16), f"hf:{hf_dir}", 1024, "float32",
                     log_dir=tmp_path_factory.mktemp("vllm_log"))
    yield eng
    eng.close()
    assert not eng.shm.exists()  # the tmpfs folder goes with it


def _hf_greedy(folder, prompt, n):
    """transformers' greedy tokens and the log-softmax of each under the same fp32 weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.no_grad():  # argmax by hand: generate() would stop at (or, with min_new_tokens, suppress) eos
        for _ in range(n):
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out, _hf_logprobs(model, prompt, out)


def _hf_logprobs(model, prompt, tokens, temperature=1.0):
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1:-1] / temperature  # [G, V]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _megatron_model(hf_dir):
    """The trainer's model (Megatron names) initialised from the HF folder."""
    from megatron.core import tensor_parallel

    from megatron_rl import config as C
    from megatron_rl.convert.runtime import start
    from megatron_rl.convert.source import initializer
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, None, [f"model.init=hf:{hf_dir}", "model.max_seq_length=256", "data.domain=arithmetic",
                                   "curriculum.enabled=false", "train.steps=0", "launch.nproc_per_node=1"])
    ctx = start()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg.model, ctx.parallel, ctx.pgs)
    initializer(cfg.model)(model)
    return model


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_greedy_tokens_equal_transformers_and_logprobs_agree(engine, hf_dir):
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        s = out.samples[0]
        want, lps = _hf_greedy(hf_dir, prompt, 12)
        assert s.token_ids == want and s.finish_reason == "length" and s.policy_versions == [0] * 12
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, lps)))
    assert worst < 1e-3, worst  # fp32 on both sides (measured ~1e-5)


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_sampled_logprobs_are_the_sampling_distributions(engine, hf_dir):
    """T=0.7, n=3: each sample's log-probs are transformers' log-softmax of logits / T at its tokens; the n samples
    of a request differ (seed + i) and the same seed gives the same samples again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0.7, max_new_tokens=10, n=3, seed=11)
    first, again = engine.generate([PROMPTS[0]] * 2, [params, params])
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) == 3
    for s in first.samples:
        want = _hf_logprobs(model, PROMPTS[0], s.token_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(s.logprobs, want)) < 1e-3


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_stop_token_ends_a_sample_and_is_kept(engine):
    greedy = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=12))[0].samples[0]
    stop = greedy.token_ids[4]
    s = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                     stop_token_ids=[stop]))[0].samples[0]
    k = greedy.token_ids.index(stop)
    assert s.token_ids == greedy.token_ids[:k + 1] and s.finish_reason == "stop"


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_weight_sync_changes_outputs_to_the_new_weights_with_versions(engine, hf_dir, tmp_path):
    """Trainer weights perturbed -> update_weights (HF names, tmpfs, reload_weights): vLLM's greedy tokens are
    then transformers' on the new weights; a request in flight across the update records both versions;
    a sync missing a tensor is refused naming it; the original weights restore the original outputs."""
    from megatron_rl.rollout.vllm_engine import write_hf

    model = _megatron_model(hf_dir)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    g = torch.Generator().manual_seed(3)
    new = {n: p * (1 + 0.5 * torch.randn(p.shape, generator=g)) for n, p in original.items()}
    rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=10))
    for _ in range(4):
        engine.step()
    assert engine.update_weights(1, new.items()) > 0
    # kept for a restart's reload; tmp: the vLLM process's TMPDIR (its vllm_dist_* rendezvous file), not /tmp
    assert sorted(p.name for p in engine.shm.iterdir()) == ["tmp", "v1"]
    assert [p.name for p in (engine.shm / "tmp").iterdir() if p.name.startswith("vllm_dist_")]
    done = []
    while engine.has_work:
        done += engine.step()
    vs = next(o for o in done if o.request_id == rid).samples[0].policy_versions
    assert vs[0] == 0 and vs[-1] == 1 and vs == sorted(vs)  # tokens before / after the update
    after = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    ref_dir = tmp_path / "new_hf"
    write_hf(new.items(), engine.arch, engine.hf, ref_dir)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (ref_dir / f).write_bytes((hf_dir / f).read_bytes())
    for prompt, a in zip(PROMPTS, after):
        assert a.samples[0].token_ids == _hf_greedy(ref_dir, prompt, 10)[0]
        assert a.samples[0].policy_versions == [1] * 10
    assert [a.samples[0].token_ids for a in after] != [b.samples[0].token_ids for b in before]
    with pytest.raises(RuntimeError, match="unwritten.*model.norm.weight"):
        engine.update_weights(2, [(n, t) for n, t in new.items() if n != "decoder.final_layernorm.weight"])
    assert engine.version == 1
    engine.update_weights(2, original.items())
    again = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert [a.samples[0].token_ids for a in again] == [b.samples[0].token_ids for b in before]


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_abort_policy_ends_requests_in_flight(engine, hf_dir):
    model = _megatron_model(hf_dir)
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=50, n=2, seed=1))
    engine.step()
    engine.update_weights(engine.version + 1, model.named_parameters(), policy="abort")
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid] and {s.finish_reason for s in outs[0].samples} == {"abort"}
    assert not engine.has_work


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_bad_requests_are_refused_naming_the_problem(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's max_seq_length"):
        engine.add_request([1] * 1020, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="token-sequence stops"):
        engine.add_request([1, 2], SamplingParams(stop=[[3, 4]]))


def test_environment_missing_or_of_another_version_is_refused():
    with pytest.raises(ConfigError, match=r"engine.vllm.python=.*no such executable.*scripts/setup_vllm.sh"):
        check_environment(VLLMConfig(python="/nonexistent/bin/python"))
    with pytest.raises(ConfigError, match=r"has no vllm installed.*scripts/setup_vllm.sh"):
        check_environment(VLLMConfig(python=sys.executable))  # the project's venv: no vLLM there
    with pytest.raises(ConfigError, match=r"has vllm 0.32.0, the backend needs 0.1.0.*setup_vllm.sh"):
        check_environment(VLLMConfig(python=str(VLLM_PY), version="0.1.0"))
    assert check_environment(VLLMConfig(python=str(VLLM_PY))) == "0.32.0"


def test_run_config_refuses_what_the_vllm_backend_does_not_serve(hf_dir):
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    base = [f"model.init=hf:{hf_dir}", "model.max_seq_length=256", "data.domain=arithmetic", "train.steps=0",
            "curriculum.enabled=false", "engine.backend=vllm", f"engine.vllm.python={VLLM_PY}"]
    C.load(RunConfig, None, [*base, "launch.nproc_per_node=1"])  # accepted
    for runner in ("dispatch", "fleet"):  # dispatched and fleet episodes call the rank's vLLM engine
        C.load(RunConfig, None, [*base, "launch.nproc_per_node=1", f"episodes.runner={runner}"])
    cases = {"parallel.pp=2": "needs parallel.tp=pp=cp=ep=1", "engine.vllm.python=/nope/python": "no such executable",
             "engine.backend=sglang": "sglang", "engine.vllm.weight_transfer=nccl": "needs CUDA",
             "engine.vllm.max_restarts=-1": "max_restarts must be >= 0",
             "engine.vllm.gpu_memory_utilization=1.5": r"gpu_memory_utilization must be in \[0, 1\)",
             "episodes.server=separate": "episodes.server=separate starts a rollout server process that builds our"}
    for override, msg in cases.items():
        with pytest.raises(ConfigError, match=msg):
            C.load(RunConfig, None, [*base, "launch.nproc_per_node=2", "episodes.runner=dispatch", override])
    with pytest.raises(ConfigError, match="model.init=hf:DIR"):
        C.load(RunConfig, None, ["engine.backend=vllm", f"engine.vllm.python={VLLM_PY}", "launch.nproc_per_node=1",
                                 "data.domain=arithmetic", "train.steps=0", "curriculum.enabled=false"])


def _train(hf_dir, out, *overrides, kill_vllm: bool = False) -> tuple[list[dict], list[dict], str]:
    """`megatron-rl train` of one GRPO step with engine.backend=vllm on the tiny model: (rl rows, all rows, its
    output). kill_vllm: SIGKILL the run's vLLM process once, as soon as it has loaded the first synced weights
    (the held-out eval's episodes then in flight, the step's rollouts to come)."""
    tok = json.loads((hf_dir / "config.json").read_text())
    exe = str(Path(sys.executable).parent / "megatron-rl")
    log = out / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [exe, "train", "configs/demo_cpu.yaml", f"output_dir={out}", f"model.init=hf:{hf_dir}",
             "model.num_attention_heads=2", "model.num_query_groups=1", f"model.vocab_size={tok['vocab_size']}",
             "model.max_seq_length=1024", "parallel.tp=1", "launch.nproc_per_node=1", "train.steps=0", "rl.steps=1",
             "rl.prompts_per_step=2", "rl.group_size=4", "rl.dynamic_sampling=false", "rl.max_new_tokens=16",
             "eval.tasks=4", "eval.k=2", "eval.every=0", "data.heldout_tasks=8", "monitor.tensorboard=false",
             "export.enabled=false", "engine.backend=vllm", f"engine.vllm.python={VLLM_PY}", *overrides],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        killed = _kill_vllm_when_ready(out / "demo" / "vllm", proc) if kill_vllm else None
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-8000:]
    assert killed is not None or not kill_vllm, "the run's vLLM process never said it was ready"
    rows = [json.loads(line) for line in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "rl"], rows, text


def _kill_vllm_when_ready(log_dir: Path, proc, timeout: float = 600) -> int | None:
    """SIGKILL the vLLM worker once its log (<run>/vllm/vllm-*.log) says it reloaded weights (the run's first
    sync, before its first eval); its pid (None: the run ended first or that never came within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for log in log_dir.glob("vllm-*.log"):
            text = log.read_text(errors="replace")
            m = re.search(r"vllm_worker\] ready: .* pid (\d+)", text)
            if m and "vllm_worker] weights reloaded" in text:
                os.kill(int(m.group(1)), signal.SIGKILL)
                return int(m.group(1))
        time.sleep(0.1)
    return None


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_on_fleet_workers_survives_a_killed_vllm_process_and_corrects_the_honest_mismatch(hf_dir, tmp_path):
    """One `megatron-rl train` launch (one vLLM start, one restart; it was two launches) with engine.backend=vllm
    serving in bf16 (engine.dtype=bf16) while the trainer holds fp32, episodes.runner=fleet (local executor;
    dispatch is served the same way, loop.dispatched.serve_while): eval, one GRPO step on vLLM's rollouts, the
    weight sync, eval.
    - Fleet: the rank serves its vLLM engine to the workers, which run the step's episodes and the evals and
      publish shards; the step trains on them (before: refused, "engine.backend=vllm runs with
      episodes.runner=inprocess").
    - Its vLLM process is SIGKILLed once it has loaded the first sync, with the eval's episodes in flight
      (seen mid-step, not at a reload): it is restarted (engine.vllm.max_restarts; metric
      vllm_restarts) and the run goes on with no episode lost: all 8 rollouts trained, every held-out task
      evaluated (before: the run stopped, "the episodes in flight are lost").
    - vLLM's bf16 behaviour log-probs really differ from the trainer's, and the loop measures it (mismatch_kl
      well above fp32's ~1e-9, yet small: the workers' log-probs are vLLM's on the synced weights), corrects it
      with the existing importance weights (rl.importance_correction=tis, truncated at is_cap=1: weights not all
      1) and alerts on it (rl.mismatch_alert_kl: a 'mismatch' row). A backend, or a worker, that handed back the
      trainer's own log-probs, or a loop that ignored vLLM's, gives mismatch_kl ~0, all weights 1 and no alert.
      No tmpfs folder is left."""
    from megatron_rl.data.shards import read_shard

    rl, rows, out = _train(hf_dir, tmp_path, "engine.dtype=bf16", "rl.importance_correction=tis",
                           "rl.trainer.loss.is_cap=1.0", "rl.mismatch_alert_kl=1e-7", "episodes.runner=fleet",
                           "episodes.fleet.executor=local", "episodes.fleet.size=1", "episodes.worker_threads=2",
                           kill_vllm=True)
    m, run = rl[0], tmp_path / "demo"
    assert re.search(r"exited \(status -9\) during step\. Restarting it \(1/2, engine.vllm.max_restarts\)", out), out
    assert m["vllm_restarts"] == 1, m
    assert [r["step"] for r in rl] == [0] and m["trained_samples"] == 8, m
    assert m["episodes_dispatched"] == 8 and m["episodes_missing"] == 0, m
    assert [(r["step"], r["tasks"]) for r in rows if r["kind"] == "eval"] == [(0, 4), (1, 4)]
    assert 1e-6 < m["mismatch_kl"] < 1e-2 and m["behaviour_kl"] > 1e-6, m  # fp32 on both sides: ~1e-9
    assert m["is_weight_mean"] < 1 - 1e-5, m  # tokens with pi_old > pi_behaviour truncated to 1
    alerts = [json.loads(line) for line in (run / "alerts.jsonl").read_text().splitlines()]
    assert [(a["step"], a["stop"]) for a in alerts if a["rule"] == "mismatch"] == [(0, False)]
    eps = [t for p in sorted((run / "rl_episodes").glob("*/*.h5")) for t in read_shard(p)]
    assert len(eps) == 8 and {int(v) for t in eps for v in t.token_versions if v >= 0} == {0}
    assert list((run / "eval_episodes").glob("*/*.h5"))  # the held-out evals ran on the workers too
    # the run's tmpfs folder (mrl-vllm-<pid of the process that drove vLLM: its log's name>-*) removed at its end;
    # by pid, as other runs on this machine may hold folders of their own meanwhile
    pids = [p.stem.split("-")[1] for p in (run / "vllm").glob("vllm-*.log")]
    assert pids and not [p for pid in pids for p in Path("/dev/shm").glob(f"mrl-vllm-{pid}-*")]


def test_engine_refuses_a_missing_environment_or_another_version_naming_the_setting(hf_dir, tmp_path):
    """Before any process starts (no vLLM start-up, nothing left on tmpfs): the engine itself checks its
    environment, so a runner that builds it without the run config's check gets the same clear error (before:
    FileNotFoundError from Popen; another version started and ran)."""
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    shm_before = set(Path("/dev/shm").glob("mrl-vllm-*"))
    with pytest.raises(ConfigError, match=r"engine.vllm.python='/nonexistent/python': no such executable.*setup_vllm"):
        VLLMEngine(VLLMConfig(python="/nonexistent/python"), EngineConfig(), f"hf:{hf_dir}", 256, log_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"has vllm 0.32.0, the backend needs 0.1.0 \(engine.vllm.version\)"):
        VLLMEngine(VLLMConfig(python=str(VLLM_PY), version="0.1.0"), EngineConfig(), f"hf:{hf_dir}", 256,
                   log_dir=tmp_path)
    assert set(Path("/dev/shm").glob("mrl-vllm-*")) == shm_before


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_a_model_vllm_cannot_load_is_a_clear_error(tmp_path):
    """A model folder whose config our side reads but whose weights file is damaged (cut in half): ConfigError
    naming model.init, vLLM's own reason and its log, and the fix (before: a raw traceback from the worker)."""
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    folder = tmp_path / "damaged"
    tiny_llama(folder, tiny_tokenizer(folder), **SHAPE)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shm_before = set(Path("/dev/shm").glob("mrl-vllm-*"))
    with pytest.raises(ConfigError, match=r"(?s)vLLM could not load model.init='hf:.*damaged'.*engine.backend=native.*"
                                          r"Its log: .*vllm-\d+.log"):
        VLLMEngine(VLLMConfig(python=str(VLLM_PY)), EngineConfig(), f"hf:{folder}", 256, log_dir=tmp_path / "log")
    assert set(Path("/dev/shm").glob("mrl-vllm-*")) == shm_before


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_served_over_http_with_the_gateway_as_dispatched_workers_and_agents_call_it(engine, hf_dir):
    """What dispatched and fleet workers call: the rank's engine served by `tp_serve`'s command loop with no
    tokenizer, as loop.dispatched.serve_while serves it: a token-id completion equals the engine's own greedy
    tokens and log-probs, /metrics answers (before: create_app read engine.model.vocab_size, None here, and
    /metrics keys vLLM's stats lacked). And the token-recording gateway on it: a black-box agent's three chat
    calls become one exact trajectory holding vLLM's log-probs and the policy version."""
    from megatron_rl.rollout.server import ServerThread
    from megatron_rl.rollout.tp_serve import TPEngineLoop
    from megatron_rl.tokenizer import HFTokenizer
    from tests.rollout.test_gateway import TOKEN, _agent, _call, _post, _trajectory

    want = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8))[0].samples[0]
    srv = ServerThread(engine, loop=TPEngineLoop(engine, None), token=TOKEN).start()  # as serve_while's
    try:
        out = _post(f"{srv.url}/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.0,
                                                  "logprobs": True})
        req = urllib.request.Request(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            metrics = r.read().decode()
    finally:
        srv.stop()
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["policy_versions"] == [engine.version] * 8
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    assert f"rollout_policy_version {engine.version}" in metrics
    srv = ServerThread(engine, loop=TPEngineLoop(engine, None), tokenizer=HFTokenizer(str(hf_dir)), gateway=True,
                       token=TOKEN).start()
    try:
        assert _call("POST", f"{srv.url}/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 2,
                                                           "return_routed_experts": True})[0] == 400
        answers = _agent(srv.url, "ep-vllm")
        (seg,) = _trajectory(srv.url, "ep-vllm")["segments"]
    finally:
        srv.stop()
    last = answers[-1]
    assert all(a["episode"]["exact"] for a in answers) and seg["calls"] == 3
    assert seg["tokens"] == last["prompt_token_ids"] + last["choices"][0]["token_ids"]
    for a in answers:  # each completion's tokens and vLLM's log-probs, as recorded
        ids, lps = a["choices"][0]["token_ids"], [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]]
        p = a["prompt_token_ids"]
        assert seg["tokens"][len(p):len(p) + len(ids)] == ids and seg["logprobs"][len(p):len(p) + len(ids)] == lps
        assert set(seg["versions"][len(p):len(p) + len(ids)]) == {engine.version}


def _greedy(engine):
    return [o.samples[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                                    max_new_tokens=10))]


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_dead_vllm_process_is_restarted_on_the_synced_weights_and_no_sample_is_lost(engine, hf_dir):
    """engine.vllm.max_restarts (2): samples in flight when the vLLM process is SIGKILLed (here seen at the next
    weight reload; the main-job test sees it mid-step) continue in a restarted process from their tokens so far
    (kept with their log-probs and versions) to their full length, on the newly synced weights (not the model
    folder's); the restart is counted. Before: the run stopped ("the episodes in flight are lost")."""
    model = _megatron_model(hf_dir)
    g = torch.Generator().manual_seed(5)
    new = [(n, p.detach() * (1 + 0.5 * torch.randn(p.shape, generator=g))) for n, p in model.named_parameters()]
    base = _greedy(engine)
    engine.update_weights(engine.version + 1, new)
    want, v = _greedy(engine), engine.version
    assert want != base
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=3))
    for _ in range(4):
        engine.step()
    before = [(list(s.token_ids), list(s.logprobs)) for s in engine._requests[rid]["samples"]]
    assert all(3 <= len(t) < 40 for t, _ in before)
    pid, restarts = engine.proc.pid, engine.restarts
    os.killpg(pid, signal.SIGKILL)
    engine.update_weights(v + 1, new)  # the same weights as v, now from the folder of v + 1: dies at the reload
    assert engine.proc.pid != pid and engine.counters["engine_restarts"] == engine.restarts == restarts + 1
    assert sorted(p.name for p in engine.shm.iterdir()) == ["tmp", f"v{v + 1}"]  # only the last sync kept
    done = []
    while engine.has_work:
        done += engine.step()
    (out,) = [o for o in done if o.request_id == rid]
    for s, (tokens, lps) in zip(out.samples, before):
        k = len(tokens)
        assert s.finish_reason == "length" and len(s.token_ids) == len(s.logprobs) == 40
        assert s.token_ids[:k] == tokens and s.logprobs[:k] == lps
        assert s.policy_versions == [v] * k + [v + 1] * (40 - k)
    assert _greedy(engine) == want  # the synced weights, not the model folder's (base)


@pytest.mark.slow  # starts a vLLM process (30-60 CPU-s; the module fixture once)
def test_hung_vllm_process_beyond_max_restarts_gives_a_clear_error_not_a_hang(engine):
    """Last in the module: it ends the module's engine. A process that stops answering mid-step (SIGSTOP) is
    killed after engine.vllm.step_timeout_s; with no restart left (max_restarts lowered to the restarts used)
    the error names both settings and the way to resume."""
    r = engine.restarts  # 1 after the test above (0 when run alone)
    engine.vcfg.max_restarts, engine.vcfg.step_timeout_s = r, 2.0
    engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=200, seed=2))
    engine.step()
    pid = engine.proc.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"(?s)vLLM engine process {pid} gave no answer to step in 2 s "
                                           rf"\(engine.vllm.step_timeout_s\); killed it.*died {r + 1} time\(s\), "
                                           rf"more than engine.vllm.max_restarts={r}.*rerun"):
        while engine.has_work:
            engine.step()
    assert time.monotonic() - t0 < 30 and engine.proc.poll() is not None
