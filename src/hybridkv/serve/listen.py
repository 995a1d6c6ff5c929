"""The server's listening socket, bound before anything heavy is imported or loaded, so
that a busy port or a bad host fails at once with a `ServeError` naming the address.

This module does not import torch.
"""

from __future__ import annotations

import socket

from hybridkv.errors import ServeError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ServeError(
            f"--host {host!r}: not an address this machine can listen on: {err}"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {err.strerror or err}; pick another --port "
            "(or stop the process using it)"
        ) from None
    sock.set_inheritable(True)
    return sock
