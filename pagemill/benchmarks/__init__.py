"""`pagemill bench`: throughput, latency and serving benchmarks modelled on `vllm bench`."""
