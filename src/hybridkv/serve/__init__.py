"""`hybridkv serve`: an OpenAI-compatible HTTP server on the reference engine.

    protocol     request bodies and their checks (400s, never 500s)
    prepare      body -> `Generation` (prompts x n choices, sampling, stop strings, limits)
    chat         chat messages -> prompt ids (the tokenizer's template; the demo's own)
    textstream   incremental text per request, cut at stop strings
    engine_loop  the one thread that owns the `LLM`: continuous batching, events out
    responses    OpenAI response / chunk / error bodies
    logprobs     engine logprobs in OpenAI's completions and chat shapes
    schemas      response models: what /openapi.json documents
    metrics      Prometheus text
    app          FastAPI routes
    listen       the listening socket (bound first: a busy port fails at once)
    server       uvicorn in the foreground or on a background thread
    (the `hybridkv serve` command itself is `hybridkv.cli.serve`)

Importing this package imports nothing heavy; `server` and `app` need the ``serve``
extra (fastapi, uvicorn) and torch.
"""
