"""Session isolation at the orchestrator: a producer that knows another producer's session id
cannot end it, and learns nothing from trying. Real processes, real sockets."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from schemas import Cancel, GenerateDone, GenerateRequest, pack_frames, unpack_frames
from specsplit.launch import Fleet

pytestmark = [pytest.mark.system]


@pytest.mark.timeout(240)
def test_another_producers_cancel_neither_ends_the_session_nor_gets_an_answer(tmp_path):
    from specsplit.client import SpecSplitClient

    fleet = Fleet.create(tmp_path)
    fleet.start(drafts=1, targets=1)
    try:
        fleet.wait_ready(drafts=1, targets=1)
        prompt = [3, 14, 15, 92, 65, 35, 89, 79]

        async def run():
            async with SpecSplitClient(fleet.orchestrator, timeout_s=120) as victim:
                alone = await victim.generate(prompt, max_new_tokens=48)
                ctx = zmq.asyncio.Context()
                attacker = ctx.socket(zmq.DEALER)
                attacker.connect(fleet.orchestrator)
                try:
                    task = asyncio.ensure_future(victim.generate(prompt, max_new_tokens=48, session_id="victim-1"))
                    for _ in range(20):  # before it is admitted, while it runs
                        await attacker.send_multipart(pack_frames(Cancel(session_id="victim-1"), "victim-1", b"x"))
                        await asyncio.sleep(0.02)
                    attacked = await task
                    answered = await attacker.poll(500)  # dropped like an unknown session: no reply
                finally:
                    attacker.close(linger=0)
                    ctx.term()
            return alone, attacked, answered, await owner_cancels()

        async def owner_cancels():  # the producer that started a session can still end it
            ctx = zmq.asyncio.Context()
            owner = ctx.socket(zmq.DEALER)
            owner.connect(fleet.orchestrator)
            try:
                req = GenerateRequest(session_id="victim-2", prompt_token_ids=prompt, max_new_tokens=3000)
                await owner.send_multipart(pack_frames(req, "victim-2", b"r1"))
                await asyncio.sleep(1.0)
                await owner.send_multipart(pack_frames(Cancel(session_id="victim-2"), "victim-2", b"r2"))
                async with asyncio.timeout(60):
                    while True:
                        msg = unpack_frames(await owner.recv_multipart()).msg
                        if isinstance(msg, GenerateDone):
                            return msg
            finally:
                owner.close(linger=0)
                ctx.term()

        alone, attacked, answered, cancelled = asyncio.run(run())
        assert attacked.finish_reason == alone.finish_reason != "cancelled"
        assert attacked.token_ids == alone.token_ids
        assert answered == 0
        assert cancelled.finish_reason == "cancelled"
        assert "cancel_refused" in fleet.log("orchestrator")
    finally:
        fleet.stop()
