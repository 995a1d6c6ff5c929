"""`hybridkv serve MODEL`: registered on `hybridkv.cli.app` at startup.

torch, fastapi and uvicorn are imported inside the command, so the rest of the CLI never
pays for them; without them the command exits 2 and names the extra to install.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated

import typer

from hybridkv.cli.engine_options import (
    DeviceOpt,
    DraftOpt,
    DtypeOpt,
    EvictionOpt,
    KvDtypeOpt,
    MemoryOpt,
    NumSpecOpt,
    SpecConfigOpt,
    SpecMethodOpt,
    StateModeOpt,
    ThreadsOpt,
    TorchCompileOpt,
    engine_speculative_config,
)
from hybridkv.cli.root import app, run_guarded
from hybridkv.errors import ServeError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_serve_deps() -> None:
    """`ServeError` naming the extra when torch, fastapi or uvicorn is missing."""
    missing = [m for m in ("torch", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeError(
            f"hybridkv serve needs {', '.join(missing)}, which is not installed; install "
            "the engine and serve extras: pip install 'hybridkv[engine,serve]'"
        )


@app.command("serve")
def serve_command(
    model: Annotated[
        str,
        typer.Argument(help="checkpoint folder (config.json + safetensors), or demo"),
    ],
    draft: DraftOpt = None,
    spec_method: SpecMethodOpt = None,
    num_spec: NumSpecOpt = None,
    speculative_config: SpecConfigOpt = None,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port)")] = 8000,
    max_model_len: Annotated[
        int | None,
        typer.Option("--max-model-len", help="prompt + output tokens per request at most"),
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option("--max-num-seqs", help="requests running at once at most")
    ] = None,
    memory: MemoryOpt = None,
    dtype: DtypeOpt = "float32",
    kv_dtype: KvDtypeOpt = "auto",
    state_mode: StateModeOpt = None,
    eviction: EvictionOpt = "chain",
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    torch_compile: TorchCompileOpt = False,
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="the model's name in the API (default: MODEL)"),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level")] = "info",
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API.

    Completions and chat (streamed or whole), /v1/models, /health and Prometheus
    /metrics, on the engine's continuous batching with prefix caching and speculative
    decoding (docs/serving.md)."""

    def body() -> None:
        check_serve_deps()
        if not 0 <= port <= 65535:
            raise ServeError(f"--port {port}: needs 0..65535")
        if threads is not None and threads < 1:
            raise ServeError(f"--threads {threads}: needs >= 1")
        if log_level not in LOG_LEVELS:
            raise ServeError(f"--log-level {log_level!r}: one of {', '.join(LOG_LEVELS)}")
        from hybridkv.serve.listen import bind

        sock = bind(host, port)  # a busy port fails now, not after loading the model
        try:
            import torch

            from hybridkv.cli.engine import load_llm
            from hybridkv.serve.server import run_server

            method, folder, k, tree = engine_speculative_config(
                speculative_config, spec_method, draft, num_spec
            )
            llm = load_llm(
                model,
                draft=folder,
                spec_method=method,
                num_spec=k,
                spec_tree=tree,
                memory=memory,
                dtype=dtype,
                device=device,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                threads=threads,
                kv_dtype=kv_dtype,
                state_mode=state_mode,
                eviction_policy=eviction,
                torch_compile=torch_compile,
            )
            name = served_model_name or model
            spec = (
                f", speculative {llm.spec_method} K={llm.num_spec_tokens}"
                if llm.spec_method
                else ""
            )
            typer.echo(
                f"hybridkv serve: {name} on http://{host}:{sock.getsockname()[1]} "
                f"(max_model_len {llm.max_model_len}, layout {llm.plan.layout}, device "
                f"{llm.device}{spec}, {torch.get_num_threads()} torch thread(s), "
                f"{'torch.compile' if torch_compile else 'eager'})",
                err=True,
            )
            run_server(llm, name, sock, log_level)
        finally:
            sock.close()

    run_guarded(False, body)
