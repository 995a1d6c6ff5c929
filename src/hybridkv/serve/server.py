"""Run the app under uvicorn: in the foreground (`hybridkv serve`) or on a background
thread (`BackgroundServer`: tests, notebooks, embedding).

The listening socket is bound before uvicorn starts (`hybridkv.serve.listen.bind`), so an
address in use is a `ServeError` with the address (not a log line and exit 1), and
``port=0`` picks a free port that `BackgroundServer.url` then reports.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn

from hybridkv.engine.llm import LLM
from hybridkv.errors import ServeError
from hybridkv.serve.app import build_app
from hybridkv.serve.chat import chat_renderer
from hybridkv.serve.engine_loop import EngineLoop
from hybridkv.serve.listen import bind
from hybridkv.serve.prepare import ModelInfo
from hybridkv.serve.textstream import text_decoder


def model_info(llm: LLM, name: str) -> ModelInfo:
    """What the HTTP side needs of ``llm`` (loads its tokenizer now, on this thread)."""
    tokenizer = llm.tokenizer
    return ModelInfo(
        name=name,
        max_model_len=llm.max_model_len,
        vocab_size=llm.vocab_size,
        encode=llm.encode,
        render_chat=chat_renderer(tokenizer, name),
        decode=text_decoder(tokenizer),
        tokenizer=tokenizer,
    )


def _server(engine: EngineLoop, info: ModelInfo, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        build_app(engine, info), log_level=log_level, timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def run_server(llm: LLM, name: str, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``llm`` on the listening ``sock`` (`bind`) until interrupted (Ctrl-C or
    SIGTERM: a normal stop, so this returns), then stop the engine loop."""
    engine = EngineLoop(llm, name)
    server = _server(engine, model_info(llm, name), log_level)
    engine.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    finally:
        engine.shutdown()


class BackgroundServer:
    """``with BackgroundServer(llm, "demo") as srv: httpx.get(srv.url + "/health")``."""

    def __init__(
        self,
        llm: LLM,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.engine = EngineLoop(llm, name)
        self._sock = bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = _server(self.engine, model_info(llm, name), log_level)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(30)
        self.engine.shutdown()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
