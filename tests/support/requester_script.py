"""One requester instance, as a process: ``python -m tests.support.requester_script URL
PREFIX KEYRING INSTANCE N [SECONDS]`` sends N requests of principal alice at once (keys
``<instance>-<i>``) with an ``AsyncClient`` and prints one JSON line per reply:
``{"key", "message_id", "status", "echo_of"}``; with SECONDS each request asks the
handler to take that long. ``result`` instead of N: print the recorded reply of each
message id given after it."""

from __future__ import annotations

import asyncio
import json
import sys

from broker_adapter import AsyncClient, Keyring, RequestTimeout


async def main(argv: list[str]) -> None:
    url, prefix, keyring_path, instance, what, *rest = argv
    keyring = Keyring.load(keyring_path)
    async with AsyncClient(url, "alice", keyring, instance=instance, prefix=prefix) as client:
        if what == "result":
            for mid in rest:
                reply = await client.result(mid)
                print(json.dumps({"message_id": mid, "status": reply and reply.status}))
            return
        payload = {"seconds": float(rest[0])} if rest else {}

        async def one(i: int) -> dict[str, object]:
            key = f"{instance}-{i}"
            mid = client.message_id(None, key)
            print(json.dumps({"sent": mid}), flush=True)
            try:
                reply = await client.request(
                    None, {"key": key, **payload}, key=key, timeout_s=60, deadline_s=120
                )
            except RequestTimeout:
                return {"key": key, "message_id": mid, "status": "timeout"}
            return {
                "key": key,
                "message_id": reply.message_id,
                "status": reply.status,
                "echo_of": (reply.result or {}).get("echo", {}).get("key"),
            }

        for line in await asyncio.gather(*(one(i) for i in range(int(what)))):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
