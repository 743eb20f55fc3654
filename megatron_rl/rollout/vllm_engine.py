"""The `engine.backend: vllm` rollout engine: a vLLM engine in a process of its own, behind the native engine's
contract (token ids in; token ids, log-probs of the sampled tokens and the policy version of every token out;
abort/continue of in-flight requests at a weight update), so the RL loop drives it as it drives
`rollout.engine.RolloutEngine`.

    engine = VLLMEngine(VLLMConfig(python=".venv-vllm/bin/python"), EngineConfig(backend="vllm"), "hf:DIR",
                        max_model_len=512, valid_vocab=V, log_dir=run_dir / "vllm")
    rid = engine.add_request([257, 72], SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=1))
    while engine.has_work:
        for out in engine.step(): ...                 # RequestOutput, as the native engine's
    engine.update_weights(7, policy.global_named_tensors(), complete=True)   # every step

The process: `engine.vllm.python` (a venv's python, or a command prefix such as `apptainer exec vllm.sif
python3`) runs `rollout/vllm_worker.py` (see there for the pipe protocol and why a pipe). One process per
engine replica (each trainer rank of a TP=1 run drives its own). A request of n samples is n vLLM requests
(sample i seeded seed + i, as the native engine; vLLM's prefix cache shares the prompt). vLLM returns the
log-prob of each sampled token under the distribution sampled from (`logprobs_mode=processed_logprobs`:
temperature applied; greedy: the plain softmax), as ours. Weight updates: the trainer's tensors (Megatron
names) are converted to HF names by the converter's tables (`convert.convert.emit_hf`), written as safetensors
into a folder on tmpfs (`engine.vllm.shm_dir`, default /dev/shm; one folder per engine, removed at close) and
loaded with `collective_rpc("reload_weights")`; every HF tensor of the model folder must be written (else
RuntimeError naming the missing). After a reload vLLM's prefix cache is emptied and requests in flight are
preempted, so their K/V is recomputed under the new weights (the native engine's kv_on_update='recompute');
tokens sampled after it carry the new version. `engine.vllm.weight_transfer: nccl` (GPUs) or `gloo` (CPU) sends the
same HF tensors from memory instead, through vLLM's weight-transfer API (`rollout/vllm_transfer.py`; the process
joins the trainer's group at every start), with the same checks, versions, prefix-cache reset and policies.

A dead vLLM process (killed, out of memory) is seen at once (end of the pipe), a hung one after
`engine.vllm.step_timeout_s` without a reply (then killed); either is restarted (`engine.vllm.max_restarts`
times per engine): the new process loads the last synced weights (their folder is kept on tmpfs while restarts
are on; with nccl / gloo a CPU copy of the last synced tensors, sent again over the new process's new group)
and every sample in flight continues from the tokens it had (prompt + its tokens so far as the new
prompt, the rest of its token budget, a new seed), so no episode is lost and the tokens already sampled keep
their log-probs and versions. One death more than that: RuntimeError naming the process, its exit status, the
setting and the tail of its log, never a hang. Start-up errors are clear errors naming the setting to fix: a
missing environment or another vLLM version (`engine.vllm.python` / `engine.vllm.version`, checked before the
process starts), a model vLLM cannot load (`model.init`, with vLLM's own last line and its log).
"""
from __future__ import annotations

import getpass
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import RequestOutput, SampleOutput
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.vllm_config import VLLMConfig, dtype_name  # noqa: F401 (dtype_name: for callers)

WORKER = Path(__file__).with_name("vllm_worker.py")


class VLLMProcessDied(RuntimeError):
    """The vLLM process exited or hung (killed): restartable."""


class VLLMHung(VLLMProcessDied):
    """The vLLM process gave no answer within its timeout (it has been killed)."""


class VLLMWorkerError(RuntimeError):
    """The vLLM process answered a message with an error (it is still up)."""


class VLLMEngine:
    """A vLLM engine process behind the native engine's contract (see the module doc)."""

    def __init__(self, vcfg: VLLMConfig, cfg, model_init: str, max_model_len: int, dtype: str = "float32",
                 valid_vocab: int | None = None, log_dir: str | Path | None = None, version: int = 0):
        from megatron_rl.convert.arch import for_hf_config
        from megatron_rl.convert.source import hf_config
        from megatron_rl.model_init import parse
        from megatron_rl.rollout.vllm_config import check_environment, check_transfer_device

        check_transfer_device(vcfg)  # nccl without CUDA: refused before any work
        check_environment(vcfg)  # a missing environment or another vLLM version: ConfigError naming the setting
        self.vcfg, self.cfg, self.version, self.dtype = vcfg, cfg, version, dtype
        self.model_init, self.restarts, self._weights = model_init, 0, None  # _weights: last synced folder
        self._kept, self._group = None, None  # nccl / gloo: last synced HF tensors (CPU), the trainer's group
        kind, self.folder = parse(model_init)
        if kind != "hf":
            raise ConfigError(f"engine.backend=vllm loads an HF model folder: model.init={model_init!r} is not "
                              f"hf:DIR (convert it with `megatron-rl convert mcore-to-hf` first)")
        self.hf = {**hf_config(model_init), "dtype": dtype, "torch_dtype": dtype}
        self.arch = for_hf_config(self.hf)
        self.valid_vocab, self.max_model_len = valid_vocab or self.hf["vocab_size"], max_model_len
        self.lock = threading.RLock()
        self.summarizer = None
        self._pending: list = []
        self._aborts: list[str] = []
        self._requests: dict[str, dict] = {}  # ours -> {prompt, n, samples: [SampleOutput], open}
        self._done: list[RequestOutput] = []
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(cfg.seed)
        self.counters = {"generated_tokens": 0, "prompt_tokens": 0, "steps": 0, "forward_s": 0.0,
                         "weight_reload_s": 0.0, "engine_restarts": 0}
        self.shm = Path(tempfile.mkdtemp(prefix=f"mrl-vllm-{os.getpid()}-", dir=vcfg.shm_dir))
        self.log_path = Path(log_dir or self.shm) / f"vllm-{os.getpid()}.log"
        self.proc = None
        try:
            self._start()
        except BaseException:
            shutil.rmtree(self.shm, ignore_errors=True)  # nothing left on tmpfs by a failed start
            raise

    # ------------------------------------------------------------------------------------ process
    def _start(self) -> None:
        conf = {"model": str(self.folder), "dtype": self.dtype, "seed": self.cfg.seed,
                "max_model_len": self.max_model_len, "max_num_seqs": self.cfg.max_running,
                "enforce_eager": self.vcfg.enforce_eager, "weight_transfer": self.vcfg.weight_transfer}
        if self.vcfg.gpu_memory_utilization:  # GPU only (EngineArgs' own field)
            conf["extra"] = {"gpu_memory_utilization": self.vcfg.gpu_memory_utilization}
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(self.vcfg.kv_cache_gb), "VLLM_DO_NOT_TRACK": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # the project's packages must not shadow the vLLM environment's
        # vLLM's temporary files (its `file://` rendezvous, vllm_dist_*) in this engine's folder, removed with it;
        # TorchInductor's cache stays where it was (a cache shared by the starts, not a temporary file)
        inductor_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
        (self.shm / "tmp").mkdir(exist_ok=True)
        env["TMPDIR"] = str(self.shm / "tmp")
        if self.vcfg.cuda_visible_devices.strip():
            env["CUDA_VISIBLE_DEVICES"] = self.vcfg.cuda_visible_devices.strip()
        if self.vcfg.cpu_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.vcfg.cpu_threads_bind
        to_w, from_p = os.pipe()
        from_w, to_p = os.pipe()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.vcfg.command(), str(WORKER), str(to_w), str(to_p), json.dumps(conf)],
                                         pass_fds=(to_w, to_p), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=env, start_new_session=True)
        os.close(to_w)
        os.close(to_p)
        self._out, self._in = os.fdopen(from_p, "w"), from_w
        self._buf = b""
        try:
            ready = self._recv(self.vcfg.start_timeout_s, "start")
        except VLLMHung as e:  # a slow start, not a model it cannot load: the message names start_timeout_s
            self._kill()
            raise RuntimeError(str(e)) from None
        except (VLLMProcessDied, VLLMWorkerError) as e:
            self._kill()
            last = str(e).strip().splitlines()[-1] if str(e).strip() else "?"
            raise ConfigError(f"vLLM could not load model.init={self.model_init!r} (engine.backend=vllm, dtype "
                              f"{self.dtype}): {last}\nCheck that vLLM {self.vcfg.version} serves this model "
                              f"(architecture, head size, dtype on this device), or use engine.backend=native. "
                              f"Its log: {self.log_path}") from None
        self.vllm_version = ready["ready"]
        if self.vllm_version.split("+")[0] != self.vcfg.version:
            self._kill()
            raise ConfigError(f"engine.vllm.python={self.vcfg.python!r} started vLLM {self.vllm_version}, the "
                              f"backend needs {self.vcfg.version} (engine.vllm.version); run `bash "
                              f"scripts/setup_vllm.sh` or point engine.vllm.python at a vLLM {self.vcfg.version}")
        if self.vcfg.weight_transfer != "file":
            self._join_group()

    def _join_group(self) -> None:
        """vLLM's init_weight_transfer_engine: the new process joins a new trainer group (at every start, so a
        restarted process re-inits it)."""
        from concurrent.futures import ThreadPoolExecutor

        from megatron_rl.rollout.vllm_transfer import TrainerGroup

        self._group = TrainerGroup(self.vcfg.weight_transfer, self.vcfg.step_timeout_s)
        self._send({"op": "wt_init", "init_info": self._group.init_info()})
        pool = ThreadPoolExecutor(1)  # both sides join at once; an error reply must not wait for our timeout
        joined = pool.submit(self._group.connect)
        try:
            self._recv(self.vcfg.start_timeout_s, "init_weight_transfer_engine")
            joined.result(timeout=self.vcfg.start_timeout_s)
        except BaseException:
            self._kill()
            raise
        finally:
            pool.shutdown(wait=False)

    def _kill_process(self) -> int:
        """SIGKILL the process's whole session (start_new_session: vLLM's helpers too) while its id is still
        reserved (not yet reaped); its exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        return self.proc.wait()

    def _kill(self) -> None:
        """Stop the process (if still up) and close this side's pipe ends."""
        if self.proc is not None:
            self._kill_process()
        if self._group is not None:
            self._group.close()
            self._group = None
        for f in (getattr(self, "_out", None),):
            try:
                f and f.close()
            except OSError:
                pass
        self._out = None
        if getattr(self, "_in", None) is not None:
            os.close(self._in)
            self._in = None

    def _send(self, msg: dict) -> None:
        try:
            self._out.write(json.dumps(msg) + "\n")
            self._out.flush()
        except (BrokenPipeError, ValueError, AttributeError):
            self._died(msg["op"])

    def _recv(self, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill_process()
                raise VLLMHung(f"vLLM engine process {self.proc.pid} gave no answer to {what} in "
                                      f"{timeout:.0f} s (engine.vllm.{'start' if what == 'start' else 'step'}"
                                      f"_timeout_s); killed it. Its log ({self.log_path}) ends:\n{self._log_tail()}")
            r, _, _ = select.select([self._in], [], [], min(left, 1.0))
            if r:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    self._died(what)
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise VLLMWorkerError(f"vLLM engine ({what}) failed:\n{reply['error']}")
        return reply

    def _died(self, what: str):
        try:
            code = self.proc.wait(timeout=30)  # its end of the pipe is closed: it is exiting
        except subprocess.TimeoutExpired:
            code = self._kill_process()
        raise VLLMProcessDied(f"vLLM engine process {self.proc.pid} exited (status {code}) during {what}. "
                              f"Its log ({self.log_path}) ends:\n{self._log_tail()}")

    def _recover(self, died: VLLMProcessDied) -> None:
        """Restart a dead or hung vLLM process (engine.vllm.max_restarts): the last synced weights reloaded, every
        sample in flight resubmitted to continue from its tokens so far. RuntimeError when out of restarts."""
        while True:
            if self.restarts >= self.vcfg.max_restarts:
                raise RuntimeError(f"{died}\nThe vLLM process died {self.restarts + 1} time(s), more than "
                                   f"engine.vllm.max_restarts={self.vcfg.max_restarts} allows; the run stops (rerun "
                                   f"the same command to resume from the last checkpoint)") from None
            self.restarts += 1
            self.counters["engine_restarts"] += 1
            head = str(died).split(" Its log (")[0]
            print(f"[megatron-rl] {head} Restarting it ({self.restarts}/{self.vcfg.max_restarts}, "
                  f"engine.vllm.max_restarts); the samples in flight continue. Its log: {self.log_path}",
                  file=sys.stderr, flush=True)
            self._kill()
            self._start()
            try:
                if self._weights is not None:
                    self._call({"op": "reload", "path": str(self._weights)}, "reload_weights", recover=False)
                if self._kept is not None:  # nccl / gloo: the last synced tensors again, by the new group
                    self._transfer(self._kept)
                break
            except VLLMProcessDied as again:
                died = again
        self._pending, self._aborts = [], []
        for rid, req in list(self._requests.items()):
            for s in req["samples"]:
                left = req["sp"]["max_new_tokens"] - len(s.token_ids)
                if s.finish_reason is None and left <= 0:
                    self._finish(rid, s, "length")
                elif s.finish_reason is None:  # continues after its own tokens, with the rest of its budget
                    sp = {**req["sp"], "max_new_tokens": left,
                          "seed": (req["seed"] + s.index + 7919 * self.restarts) % 2**63}
                    self._pending.append([f"{rid}#{s.index}", req["prompt"] + s.token_ids, sp])

    def _call(self, msg: dict, what: str, recover: bool = True) -> dict | None:
        """One message and its reply; a dead or hung process is restarted (None returned: the message is
        void, the samples in flight resubmitted) unless `recover` is False (then VLLMProcessDied)."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._died(what)
            self._send(msg)
            return self._recv(self.vcfg.step_timeout_s, what)
        except VLLMProcessDied as e:
            if not recover:
                raise
            self._recover(e)
            return None

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the vLLM process and remove the tmpfs folder."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._send({"op": "close"})
                self.proc.wait(timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self._kill()
        shutil.rmtree(self.shm, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------------------------ requests
    model = None
    """No in-process model (the weights live in the vLLM process)."""
    cache = None
    """No paged cache of ours (the rollout server reads `cache.routes`: no MoE routes recorded)."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, turn_boundaries: list[int] | None = None,
                    compression=None) -> str:
        """Queue a request (sent with the next step); returns its id. ValueError naming the problem."""
        prompt, record = self.compress(prompt_token_ids, turn_boundaries, compression)
        return self.add_prepared(prompt, params, request_id, record)

    def compress(self, prompt_token_ids, turn_boundaries=None, compression=None):
        """As the native engine's (rollout/compression.py; no summarizer)."""
        from megatron_rl.rollout.engine import RolloutEngine

        return RolloutEngine.compress(self, prompt_token_ids, turn_boundaries, compression)

    def add_prepared(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                     compression=None) -> str:
        params = params or SamplingParams()
        params.validate()
        if params.stop:
            raise ValueError("token-sequence stops (stop) are not supported by engine.backend=vllm; use "
                             "stop_token_ids, or engine.backend=native")
        if params.n > self.cfg.max_running:
            raise ValueError(f"n={params.n} samples of one request exceed engine.max_running={self.cfg.max_running}")
        prompt = [int(t) for t in prompt]
        self._check_prompt(prompt, params)
        with self.lock:
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in flight")
            seed = params.seed if params.seed is not None else int(torch.randint(2**31, (1,), generator=self._seed_gen))
            sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                  "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}
            for i in range(params.n):
                self._pending.append([f"{rid}#{i}", prompt, {**sp, "seed": (seed + i) % 2**63}])
            samples = [SampleOutput(i, [], [], [], None) for i in range(params.n)]
            self._requests[rid] = {"prompt": prompt, "open": params.n, "compression": compression, "sp": sp,
                                   "seed": seed, "samples": samples}
            self.counters["prompt_tokens"] += len(prompt)
        return rid

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt_token_ids is empty; send at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.hf["vocab_size"]]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.hf['vocab_size']})")
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
                             f"model's max_seq_length {self.max_model_len}; shorten the prompt or lower max_tokens")

    def abort(self, request_id: str) -> bool:
        """End a request now (finish reason 'abort'); False if unknown or finished."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            for s in req["samples"]:
                if s.finish_reason is None:
                    self._aborts.append(f"{request_id}#{s.index}")
                    self._finish(request_id, s, "abort")
            return True

    @property
    def has_work(self) -> bool:
        return bool(self._requests) or bool(self._done)

    def step(self) -> list[RequestOutput]:
        """Send the new requests and aborts, run one vLLM engine step; returns the requests that finished."""
        with self.lock:
            if self._requests:
                msg = {"op": "step", "add": self._pending, "abort": self._aborts}
                self._pending, self._aborts = [], []
                t0 = time.perf_counter()
                reply = self._call(msg, "step")  # None: the process was restarted, the samples resubmitted
                self.counters["forward_s"] += time.perf_counter() - t0
                self.counters["steps"] += 1
                for sub, tokens, lps, finish in (reply or {}).get("outputs", []):
                    self._take(sub, tokens, lps, finish)
            return self.pop_finished()

    def _take(self, sub: str, tokens: list[int], lps: list[float], finish: str | None) -> None:
        rid, _, i = sub.rpartition("#")
        req = self._requests.get(rid)
        if req is None:
            return  # aborted here before vLLM heard of it
        s = req["samples"][int(i)]
        if s.finish_reason is not None:
            return
        s.token_ids += tokens
        s.logprobs += lps
        s.policy_versions += [self.version] * len(tokens)
        self.counters["generated_tokens"] += len(tokens)
        if finish is not None:
            self._finish(rid, s, {"stop": "stop", "length": "length"}.get(finish, "abort"))

    def _finish(self, rid: str, s: SampleOutput, reason: str) -> None:
        s.finish_reason = reason
        req = self._requests[rid]
        req["open"] -= 1
        if req["open"] == 0:
            del self._requests[rid]
            self._done.append(RequestOutput(rid, req["prompt"], req["samples"], req["compression"]))

    def pop_finished(self) -> list[RequestOutput]:
        with self.lock:
            done, self._done = self._done, []
            return done

    def generate(self, prompts: list[list[int]], params=None, turn_boundaries=None, compression=None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        from megatron_rl.rollout.engine import RolloutEngine

        return RolloutEngine.generate(self, prompts, params, turn_boundaries, compression)

    # ------------------------------------------------------------------------------------ weights
    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       policy: str | None = None, complete: bool = True) -> int:
        """Convert the trainer's tensors (Megatron names) to HF names, write them as safetensors on tmpfs and
        reload them into vLLM (between steps; weight_transfer nccl / gloo: broadcast them, `_update_transfer`);
        returns the tensors written. Every HF tensor of the model
        folder must be written (RuntimeError naming the missing ones)."""
        policy = policy or self.cfg.update_policy
        if policy not in ("continue", "abort"):
            raise ValueError(f"update policy {policy!r}: use 'continue' or 'abort'")
        if self.vcfg.weight_transfer != "file":
            return self._update_transfer(version, named_tensors, policy, complete)
        with self.lock:
            folder = self.shm / f"v{version}"
            try:
                names = write_hf(named_tensors, self.arch, self.hf, folder)
                self._check_complete(version, names, complete)
                self._apply_policy(policy)
                t0 = time.perf_counter()
                self._reload(folder)
                self.counters["weight_reload_s"] += time.perf_counter() - t0
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._keep(folder)
            self.version = version
            return len(names)

    def _check_complete(self, version: int, names: Iterable[str], complete: bool) -> None:
        missing = sorted(expected_names(self.folder) - set(names)) if complete else []
        if missing:
            raise RuntimeError(f"weight sync to policy version {version} left {len(missing)} vLLM tensors "
                               f"unwritten (HF names of {self.folder}): {missing[:8]}")

    def _apply_policy(self, policy: str) -> None:
        if policy == "abort":
            for rid in list(self._requests):
                self.abort(rid)

    def _reload(self, folder: Path) -> None:
        """reload_weights from `folder`; a process that dies meanwhile is restarted on exactly these weights."""
        try:
            self._call({"op": "reload", "path": str(folder)}, "reload_weights", recover=False)
        except VLLMProcessDied as e:
            old, self._weights = self._weights, folder
            try:
                self._recover(e)  # the new process loads `folder`
            finally:
                self._weights = old

    def _keep(self, folder: Path) -> None:
        """The synced folder stays for a restart's reload (engine.vllm.max_restarts > 0); the previous goes."""
        if self._weights is not None and self._weights != folder:
            shutil.rmtree(self._weights, ignore_errors=True)
        self._weights = folder if self.vcfg.max_restarts > 0 else None
        if self._weights is None:
            shutil.rmtree(folder, ignore_errors=True)

    def _update_transfer(self, version: int, named_tensors, policy: str, complete: bool) -> int:
        """engine.vllm.weight_transfer=nccl|gloo: vLLM's weight-transfer API (rollout/vllm_transfer.py): the HF
        tensors (the file route's names, dtypes, shapes) broadcast from memory, no folder. Restarts: the process
        that replaces a dead one joins a new group at its start and receives the last synced tensors by it (a
        CPU copy kept while engine.vllm.max_restarts > 0, as the file route keeps its folder)."""
        from megatron_rl.rollout.vllm_transfer import hf_tensors

        with self.lock:
            tensors = hf_tensors(named_tensors, self.arch, self.hf)
            self._check_complete(version, tensors, complete)
            self._apply_policy(policy)
            t0 = time.perf_counter()
            try:
                self._transfer(tensors)
            except VLLMProcessDied as e:
                old, self._kept = self._kept, tensors
                try:
                    self._recover(e)  # the new process receives `tensors`
                finally:
                    self._kept = old
            self.counters["weight_reload_s"] += time.perf_counter() - t0
            keep = self.vcfg.max_restarts > 0
            self._kept = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()} if keep else None
            self.version = version
            return len(tensors)

    def _transfer(self, tensors: dict[str, torch.Tensor]) -> None:
        """One weight-transfer round: the worker's start/update/finish RPCs while this side broadcasts. A failed
        broadcast leaves the group unusable (vLLM's rule): the process is killed, VLLMProcessDied."""
        from megatron_rl.rollout.vllm_transfer import update_info

        if self.proc is None or self.proc.poll() is not None:
            self._died("update_weights")
        self._send({"op": "wt_update", "update_info": update_info(tensors)})
        try:
            self._group.broadcast(tensors)
        except RuntimeError as e:
            if self.proc.poll() is None:
                self._kill_process()
            raise VLLMProcessDied(f"weight transfer to vLLM engine process {self.proc.pid} failed ({e}); the "
                                  f"process is stopped (status {self.proc.returncode}). Its log ({self.log_path}) "
                                  f"ends:\n{self._log_tail()}") from None
        self._recv(self.vcfg.step_timeout_s, "update_weights")

    def stats(self) -> dict:
        with self.lock:
            running = sum(s.finish_reason is None for r in self._requests.values() for s in r["samples"])
            # the rollout server's /metrics reads these; vLLM's own KV blocks and preemptions are not reported
            return {"queue_length": len(self._pending), "requests_in_flight": len(self._requests),
                    "running": running, "kv_blocks_used": 0, "kv_blocks_total": 0, "preemptions": 0,
                    "policy_version": self.version, "backend": "vllm", **self.counters}


def write_hf(named: Iterable[tuple[str, torch.Tensor]], arch, hf: dict, folder: Path) -> list[str]:
    """Megatron-named tensors -> an HF safetensors folder (the converter's tables, `convert.convert.emit_hf`,
    in hf['dtype']); returns the HF names written."""
    from megatron_rl.convert.convert import emit_hf
    from megatron_rl.convert.hf_io import HFWriter

    writer = HFWriter(folder)
    emit_hf({n: t.detach() for n, t in named}, arch, hf, writer)
    return writer.finish()


def expected_names(folder: Path) -> set[str]:
    """The HF tensor names of a model folder (what a full weight sync must write)."""
    from megatron_rl.convert.hf_io import HFReader

    r = HFReader(folder)
    try:
        return set(r.weight_map)
    finally:
        r.close()
