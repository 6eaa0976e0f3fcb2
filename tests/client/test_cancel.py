"""`AsyncClient.stream` cancelled at the worst moment still aborts its request.

Lifecycle: an in-process ROUTER stands in for the coordinator; the test starts one stream, waits
until it is parked on its queue, then, in one step of the event loop, hands it a Delta and
cancels it (what the gateway's `Fanout.close()` does while tokens flow). The stream must end
cancelled and the fake coordinator must receive its AbortRequest. On Python 3.11
`asyncio.wait_for` returned the Delta and dropped the cancellation (gh-86296): the stream ran on
without aborting, which is why the gateway's disconnect test sometimes saw no abort.
"""
import asyncio

import zmq
import zmq.asyncio

from pdserve_client.library import AsyncClient
from pdserve_client.protocol import AbortRequest, ClientToCoordinator, Delta, GenerateRequest, decoder
from tests.helpers import free_port


def test_cancel_as_a_delta_arrives_aborts_the_request():
    async def go():
        addr = f"tcp://127.0.0.1:{free_port()}"
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(addr)
        dec = decoder(ClientToCoordinator)
        client = AsyncClient(addr, timeout=30)
        try:
            async def pump():
                async for _ in client.stream("hi", request_id="r1", max_tokens=5):
                    pass

            task = asyncio.create_task(pump())
            ident, body = await asyncio.wait_for(router.recv_multipart(), 10)
            assert isinstance(dec.decode(body), GenerateRequest)
            q = client.queues["r1"]
            for _ in range(1000):  # until the stream waits on its queue
                if q._getters:
                    break
                await asyncio.sleep(0.001)
            assert q._getters
            q.put_nowait(Delta("r1", [5], "a"))  # the delta and the cancel land in the same loop step
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5)
            assert task in done and task.cancelled(), "the cancellation was swallowed: the stream kept running"
            _, body = await asyncio.wait_for(router.recv_multipart(), 5)
            assert dec.decode(body) == AbortRequest("r1")
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(go())
