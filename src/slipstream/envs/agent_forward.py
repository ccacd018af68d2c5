"""Inside a sandboxed agent run (envs/agent_launch.py, `SandboxLauncher`): the first process of
the sandbox. It listens on 127.0.0.1:PORT of the sandbox's own network namespace (its loopback
is all that namespace has), then starts the agent, and forwards each connection the agent makes
there to the episode endpoint's Unix socket, which is bind-mounted into the sandbox. It exits
with the agent's exit code (128 + N when a signal N killed it, as a shell reports it); the
agent's leftover processes die with the sandbox's pid namespace when it exits.

    python -I -S agent_forward.py PORT SOCKET_PATH ARGV...

Listening comes before the agent starts, so the agent's first call finds the port open. Run
by path with the standard library only (`-I -S`): nothing of slipstream is imported here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

CHUNK_BYTES = 1 << 16


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src's EOF, then half-close dst (the other direction goes on)."""
    try:
        while data := src.recv(CHUNK_BYTES):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _connection(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:  # the episode ended: the agent sees a closed connection
        upstream.close()
        client.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_connection, args=(client, path), daemon=True).start()


def main(argv: list[str]) -> int:
    port, path, command = int(argv[1]), argv[2], argv[3:]
    listener = socket.create_server(("127.0.0.1", port), backlog=64)
    threading.Thread(target=_accept, args=(listener, path), daemon=True).start()
    # stdin/stdout/stderr, cwd and environment are the agent's: inherited as they are
    code = subprocess.Popen(command).wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    os._exit(main(sys.argv))  # daemon threads blocked in accept/recv: no interpreter teardown
