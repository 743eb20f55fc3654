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


def _engine(conf: dict):
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(model=conf["model"], dtype=conf.get("dtype", "auto"), seed=int(conf.get("seed", 0)),
                      max_model_len=int(conf["max_model_len"]), max_num_seqs=int(conf["max_num_seqs"]),
                      enforce_eager=bool(conf.get("enforce_eager", True)), enable_prefix_caching=True,
                      generation_config="vllm", logprobs_mode="processed_logprobs", disable_log_stats=True,
                      skip_tokenizer_init=False,
                      # no prompt split over steps: vLLM 0.32 on CPU fails a seeded request whose partial-prefill
                      # token is discarded ("CPU Generator does not use offset")
                      enable_chunked_prefill=False,
                      max_num_batched_tokens=max(int(conf["max_model_len"]), 2048), **conf.get("extra", {}))
    return LLMEngine.from_engine_args(args)


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
