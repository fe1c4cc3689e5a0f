"""Benchmark commands (`thoughtjax bench ...`): tables on stdout, JSON on request.

Imports inside the benchmark functions are deferred on purpose: ``thoughtjax bench X`` loads what X measures
(its peer's client, plotting, the server) and nothing the other benchmarks need.

:data:`BENCHMARKS` names each benchmark module with a one-line description; ``thoughtjax bench --help`` lists
them without importing any (each module's docstring says more).
"""

BENCHMARKS = {
  "decode": "prefill/decode throughput, first-token latency, start-up and memory (llama.cpp beside it if installed)",
  "kernels": "each kernel op: XLA reference against the Pallas kernel and a CUDA C kernel",
  "registry": "what restoring from a registry costs and what composing into one program buys",
  "synthesis": "what planning costs, how well it predicts latency, what it buys, and the hint router",
  "speculative": "how well a model's own early exits (and n-grams) draft for it, and what speculation buys",
  "serve": "the gRPC server with continuous batching against the library's static batch (or llama-server)",
  "structured": "whether extraction outputs parse and validate, with and without a JSON schema",
  "prefix": "time to first token in a slot engine with and without the prefix cache",
  "idle": "scale to zero and back on a real `thoughtjax serve` process",
  "shapes": "a second path of the same shape in a warm process, against the path that has run",
  "layers": "the unrolled program against the layer-indexed one, in the same run",
}
