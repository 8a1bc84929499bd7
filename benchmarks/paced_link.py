"""A loopback TCP proxy whose answers share one paced link: a network slower than the machine.

On loopback the hosted store's bytes move as fast as the two cores can copy them, so the fetch is
CPU time that competes with the forward it should overlap. A fleet's engines reach their store over
a network whose bandwidth, not the engine's CPU, bounds the fetch. ``vllm_fleet.py
--link-mb-per-s`` puts this proxy between the engines and ``kvcdn serve`` (whose ``--public-url``
names the proxy, so the signed chunk URLs go through it too).

Run: ``python paced_link.py LISTEN_PORT TARGET_PORT MB_PER_S``. Every byte from the target back to
a client waits for its turn on the one link (all connections together at most ``MB_PER_S``
megabytes per second); requests go through unpaced. Prints ``ready`` once listening.
"""

from __future__ import annotations

import asyncio
import sys

PIECE = 256 << 10


class Link:
    """One link's schedule: each piece leaves once the pieces before it (any connection's) have."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    async def carry(self, size: int) -> None:
        now = asyncio.get_running_loop().time()
        self.free_at = max(now, self.free_at) + size / self.bytes_per_s
        await asyncio.sleep(self.free_at - now)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link | None) -> None:
    try:
        while data := await reader.read(PIECE):
            if link is not None:
                await link.carry(len(data))
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(listen: int, target: int, mb_per_s: float) -> None:
    link = Link(mb_per_s * 1e6)

    async def connected(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, server_w, None), pipe(server_r, client_w, link))

    server = await asyncio.start_server(connected, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
