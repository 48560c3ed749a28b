"""The driver of the two-node Ray test, run inside the head node's network namespace: connects to the cluster at
$RAY_ADDRESS, runs a TP=2 engine with the `ray` executor, prints one JSON line: each prompt's greedy token ids, its
logprobs and the IP address of the node each rank ran on."""

from __future__ import annotations

import json
import sys


def node_ip(model) -> str:
    """The address Ray advertises for the node this rank runs on."""
    import ray

    return ray.util.get_node_ip_address()


def main(model: str, max_tokens: int, prompts: list[str]) -> None:
    """Generate, report, shut down."""
    import ray

    from pagemill import LLM, SamplingParams

    ray.init(log_to_driver=False)  # the cluster at $RAY_ADDRESS
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="8MiB",
              max_model_len=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1,
                                                    ignore_eos=True), use_tqdm=False)
        ips = llm.apply_model(node_ip)
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"token_ids": [o.outputs[0].token_ids for o in outs],
                      "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                   for o in outs],
                      "node_ips": ips}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
