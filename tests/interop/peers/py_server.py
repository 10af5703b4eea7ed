"""Interop peer: Python `mcp` 2.3.0 MCPServer with one typed `echo` tool.

Usage:
    py_server.py stdio
    py_server.py http [--json-response] [--stateless]

In http mode the script binds a loopback socket to port 0 itself, prints "LISTENING <port>" on
stdout, and hands that very socket to uvicorn, so no other process can take the port in between.
The endpoint is http://127.0.0.1:<port>/mcp.
"""

import argparse
import asyncio
import socket
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("iteron-interop-python", version="2.3.0")


@server.tool(description="Return the given text unchanged")
def echo(text: str) -> str:
    return text


def serve_http(json_response: bool, stateless: bool) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    app = server.streamable_http_app(
        json_response=json_response,
        stateless_http=stateless,
        host="127.0.0.1",
    )
    config = uvicorn.Config(app, log_level="warning")
    # The socket already listens: connections made from now on wait in its backlog.
    print(f"LISTENING {port}", flush=True)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--json-response", action="store_true")
    parser.add_argument("--stateless", action="store_true")
    args = parser.parse_args()
    if args.transport == "stdio":
        server.run("stdio")
    else:
        serve_http(args.json_response, args.stateless)
    return 0


if __name__ == "__main__":
    sys.exit(main())
