"""The vLLM side of the `engine.backend: vllm` rollout engine: a script run by the vLLM environment's python
(`engine.vllm.python`, a venv of its own: vLLM pins torch and transformers versions the project's venv cannot
hold), never imported by the project (it imports nothing of megatron_rl: that environment does not have it).

    <vllm python> vllm_worker.py IN_FD OUT_FD '<json engine settings>'

It builds one `vllm.LLMEngine` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no EngineCore process of its
own, so the proxy's process is the only one to watch) and answers newline-delimited JSON messages on the pipe
fds, one reply per message, in order (`rollout/vllm_engine.py` is the other side):

    {"op": "step", "add": [[rid, prompt ids, sampling dict], ...], "abort": [rid, ...]}
        -> {"outputs": [[rid, token ids, log-probs, finish reason | null], ...], "unfinished": k}
           one vLLM engine step after adding/aborting; `outputs` are the new tokens of each request this step
           (vLLM's DELTA outputs), the finish reason when it ended.
    {"op": "reload", "path": DIR}   -> {"seconds": s}   collective_rpc("reload_weights", weights_path=DIR)
    {"op": "wt_init", "init_info": {...}} -> {}      collective_rpc("init_weight_transfer_engine"): joins the
           trainer's process group (engine.vllm.weight_transfer nccl / gloo; see rollout/vllm_transfer.py)
    {"op": "wt_update", "update_info": {"names", "dtype_names", "shapes"}} -> {"seconds": s}
           collective_rpc start_weight_update, update_weights (receives the trainer's broadcast), finish_weight_update
    {"op": "close"}                 -> exits (also when the pipe closes: the proxy's process is gone)
A failure of one message is answered {"error": "...traceback..."} and the worker goes on; the first line
written is {"ready": vllm version} or {"error": ...}. Why a pipe and not vLLM's OpenAI server: the proxy steps
the engine in lock-step with the RL loop (add, step, finish, reload between steps), exactly as it steps the
native engine, with no HTTP, port or token to manage and no polling; death of the process is seen at once as
the pipe's end.
"""
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

WEIGHT_TRANSFER_ENGINE = "megatron_rl_torch_dist"
"""The name this worker registers its weight-transfer engine under (vLLM's WeightTransferConfig.backend)."""


def _engine(conf: dict):
    from vllm import EngineArgs, LLMEngine

    extra = dict(conf.get("extra", {}))
    if conf.get("weight_transfer", "file") != "file":  # nccl / gloo: vLLM's weight-transfer API, our engine
        _register_weight_transfer_engine()
        extra["weight_transfer_config"] = {"backend": WEIGHT_TRANSFER_ENGINE}
    args = EngineArgs(model=conf["model"], dtype=conf.get("dtype", "auto"), seed=int(conf.get("seed", 0)),
                      max_model_len=int(conf["max_model_len"]), max_num_seqs=int(conf["max_num_seqs"]),
                      enforce_eager=bool(conf.get("enforce_eager", True)), enable_prefix_caching=True,
                      generation_config="vllm", logprobs_mode="processed_logprobs", disable_log_stats=True,
                      skip_tokenizer_init=False,
                      # no prompt split over steps: vLLM 0.32 on CPU fails a seeded request whose partial-prefill
                      # token is discarded ("CPU Generator does not use offset")
                      enable_chunked_prefill=False,
                      max_num_batched_tokens=max(int(conf["max_model_len"]), 2048), **extra)
    return LLMEngine.from_engine_args(args)


@dataclass
class TorchDistInitInfo:
    """init_weight_transfer_engine's argument (rollout/vllm_transfer.TrainerGroup.init_info makes it)."""

    master_address: str
    master_port: int
    rank_offset: int  # this worker's rank = its DP * TP * PP rank + rank_offset (the trainer is rank 0)
    world_size: int
    backend: str  # nccl (GPU) or gloo (CPU)
    timeout_s: float


def _register_weight_transfer_engine() -> None:
    """Register (once) vLLM's NCCL weight-transfer engine with its group made by torch: the same lifecycle
    (start_weight_update / update_weights / finish_weight_update: layer-wise reload around the update, inherited)
    and per-update metadata (NCCLWeightTransferUpdateInfo: names, dtype names, shapes, received one tensor at a
    time into `model.load_weights`, as its unpacked path), over a torch process group the project's side can join
    without vLLM: backend nccl on GPUs, gloo on CPU."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    class TorchDistWeightTransferEngine(NCCLWeightTransferEngine):
        init_info_cls = TorchDistInitInfo

        def init_transfer_engine(self, init_info: TorchDistInitInfo) -> None:
            from datetime import timedelta

            from vllm.distributed.utils import stateless_init_torch_distributed_process_group

            p = self.parallel_config
            rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
            self.backend, self.packed = init_info.backend, False
            self.model_update_group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.backend,
                timeout=timedelta(seconds=init_info.timeout_s))

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():  # the base class's sync, which raises on a CPU-only build
                torch.accelerator.synchronize()

        def receive_weights(self, update_info) -> None:
            from torch.distributed import BroadcastOptions
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            if self.model_update_group is None:
                raise RuntimeError("weight transfer not initialised: init_weight_transfer_engine first")
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            device = self.device if self.backend == "nccl" else torch.device("cpu")
            with disable_mtp_completeness_check():
                for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                    weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)
                    self.model_update_group.broadcast([weight], opts).wait()
                    self.model.load_weights([(name, weight)])
                    del weight

        def shutdown(self) -> None:
            pg, self.model_update_group = self.model_update_group, None
            if pg is not None:
                pg.shutdown()

    try:
        WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_ENGINE, TorchDistWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


def _params(d: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=1, temperature=float(d["temperature"]), top_p=float(d["top_p"]),
                          top_k=int(d["top_k"]) or -1,
                          max_tokens=int(d["max_new_tokens"]), seed=d.get("seed"), logprobs=0, ignore_eos=True,
                          stop_token_ids=list(d["stop_token_ids"]), detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def _retie(wrapper) -> None:
    """A tied output layer is not in the checkpoint, so vLLM's in-place reload leaves it as it was processed
    after the first load ("ParallelLMHead: Failed to load weights"): on CPU its GEMM (`cpu_linear`, packed at
    load) still holds the old embedding. Tie it to the new embedding again and redo that processing; without
    this the logits would come from the old embedding (measured: log-probs off by 0.8 after an update)."""
    worker = getattr(wrapper, "worker", wrapper)
    model = worker.model_runner.get_model()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not tied or embed is None or head is None or head is embed:
        return
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class Worker:
    def __init__(self, engine):
        self.engine = engine
        self.ids: dict[str, str] = {}  # vLLM's internal request id -> ours

    def step(self, msg: dict) -> dict:
        from vllm.inputs import TokensPrompt

        for rid, prompt, params in msg.get("add", []):
            self.ids[self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), _params(params))] = rid
        internal = {v: k for k, v in self.ids.items()}
        aborts = [internal[r] for r in msg.get("abort", []) if r in internal]
        if aborts:
            self.engine.abort_request(aborts)
            for a in aborts:
                self.ids.pop(a, None)
        out = []
        if self.engine.has_unfinished_requests():
            for o in self.engine.step():
                rid = self.ids.get(o.request_id, o.request_id)
                c = o.outputs[0]
                lps = [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])]
                finish = c.finish_reason if o.finished else None
                out.append([rid, list(c.token_ids), lps, finish])
                if o.finished:
                    self.ids.pop(o.request_id, None)
        return {"outputs": out, "unfinished": self.engine.get_num_unfinished_requests()}

    def reload(self, msg: dict) -> dict:
        t0 = time.perf_counter()
        self.engine.collective_rpc("reload_weights", kwargs={"weights_path": msg["path"]})
        self.engine.collective_rpc(_retie)  # in this process (no multiprocessing): a plain callable
        # K/V of the old weights are never reused: the prefix cache is emptied and requests in flight are
        # preempted (their K/V recomputed under the new weights, as the native engine's kv_on_update=recompute)
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after reload_weights")
        print(f"[megatron-rl vllm_worker] weights reloaded from {msg['path']}", file=sys.stderr, flush=True)
        return {"seconds": time.perf_counter() - t0}

    def wt_init(self, msg: dict) -> dict:
        self.engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": msg["init_info"]})
        print(f"[megatron-rl vllm_worker] joined the trainer's {msg['init_info']['backend']} weight-transfer group",
              file=sys.stderr, flush=True)
        return {}

    def wt_update(self, msg: dict) -> dict:
        """vLLM's weight-transfer round (the trainer broadcasts meanwhile), then as `reload` after it."""
        t0 = time.perf_counter()
        self.engine.collective_rpc("start_weight_update")
        self.engine.collective_rpc("update_weights", kwargs={"update_info": msg["update_info"]})
        self.engine.collective_rpc("finish_weight_update")
        self.engine.collective_rpc(_retie)
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after update_weights")
        print(f"[megatron-rl vllm_worker] {len(msg['update_info']['names'])} tensors received by weight transfer",
              file=sys.stderr, flush=True)
        return {"seconds": time.perf_counter() - t0}


def main() -> None:
    fin, fout = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")

    def send(obj) -> None:
        fout.write(json.dumps(obj) + "\n")
        fout.flush()

    try:
        import vllm

        worker = Worker(_engine(json.loads(sys.argv[3])))
    except BaseException:  # noqa: BLE001 - reported to the proxy, which raises it with the message
        send({"error": traceback.format_exc()})
        return
    send({"ready": vllm.__version__})
    print(f"[megatron-rl vllm_worker] ready: vLLM {vllm.__version__}, pid {os.getpid()}", file=sys.stderr, flush=True)
    for line in fin:
        msg = json.loads(line)
        if msg["op"] == "close":
            fout.close()
            os._exit(0)  # no engine shutdown to wait for: the process and its memory go at once
        try:
            send(getattr(worker, msg["op"])(msg))
        except Exception:  # noqa: BLE001 - one failed message, the engine stays up
            send({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
