"""The socket baseline: a minimal asyncio NDJSON server (``python ndjson_server.py PATH``).

It reads one JSON request per line and answers ``{"id": …, "result": true}``: the least a
line-oriented JSON server on asyncio can do per request, to compare gpuwatch's daemon with.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        request = json.loads(line)
        writer.write(json.dumps({"id": request.get("id"), "result": True}).encode() + b"\n")
        await writer.drain()
    writer.close()


async def main(path: str) -> None:
    server = await asyncio.start_unix_server(handle, path)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
