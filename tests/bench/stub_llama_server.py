"""A stand-in for llama.cpp's ``llama-server`` (run as a script): the same command line (``-m``, ``--port``,
``--parallel``, ``-c`` and the rest, accepted and ignored), ``GET /health`` and a streaming
``POST /v1/chat/completions`` that sends ``max_tokens`` fixed content chunks, the finish chunk, the usage chunk
(``stream_options.include_usage``) and ``[DONE]``. It records its command line in ``<gguf>.argv.json`` and each
request body in ``<gguf>.requests`` (one JSON a line), so a test can check what the benchmark asked.
"""

import json
import sys

from aiohttp import web

argv = sys.argv[1:]
gguf = argv[argv.index("-m") + 1]
port = int(argv[argv.index("--port") + 1])
with open(gguf + ".argv.json", "w") as f:
  json.dump(argv, f)
log = open(gguf + ".requests", "a")  # noqa: SIM115 (open for the process's life)


async def health(request):
  return web.json_response({"status": "ok"})


async def chat(request):
  body = await request.json()
  log.write(json.dumps(body) + "\n")
  log.flush()
  n = body.get("max_tokens", 16)
  head = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": gguf}
  sse = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
  await sse.prepare(request)

  async def send(obj):
    await sse.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

  await send(head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]})
  for i in range(n):
    await send(head | {"choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]})
  await send(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
  if (body.get("stream_options") or {}).get("include_usage"):
    usage = {"prompt_tokens": len(body["messages"][0]["content"].split()), "completion_tokens": n}
    await send(head | {"choices": [], "usage": usage | {"total_tokens": usage["prompt_tokens"] + n}})
  await sse.write(b"data: [DONE]\n\n")
  await sse.write_eof()
  return sse


app = web.Application()
app.router.add_get("/health", health)
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=port, print=None)
