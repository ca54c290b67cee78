"""Session isolation at the orchestrator: a producer that knows another producer's session id
cannot end it, and learns nothing from trying. Real processes, real sockets."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from schemas import Cancel, GenerateDone, GenerateRequest, Heartbeat, TokenChunk, pack_frames, unpack_frames
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
                ctx = zmq.Context()
                attacker = ctx.socket(zmq.DEALER)
                attacker.connect(fleet.orchestrator)
                attacks = []

                def attack(_tokens=None) -> None:
                    attacker.send_multipart(pack_frames(Cancel(session_id="victim-1"), "victim-1", b"x"))
                    attacks.append(_tokens is not None)

                try:
                    # on events: before it is admitted, and on every chunk it streams (so while it
                    # certainly runs), whatever the machine's speed
                    task = asyncio.ensure_future(victim.generate(prompt, max_new_tokens=48, session_id="victim-1",
                                                                 on_tokens=attack))
                    attack()
                    attacked = await task
                    # then a ping on the same connection: its answer comes after any answer to the
                    # Cancels (one connection, in order), so nothing before it means no answer at all
                    attacker.send_multipart(pack_frames(Heartbeat(), "-", b"ping"))
                    assert await asyncio.to_thread(attacker.poll, 60_000), "no answer to the ping"  # a hang guard
                    first = unpack_frames(attacker.recv_multipart())
                finally:
                    attacker.close(linger=0)
                    ctx.term()
            return alone, attacked, (first, attacks), await owner_cancels()

        async def owner_cancels():  # the producer that started a session can still end it
            ctx = zmq.asyncio.Context()
            owner = ctx.socket(zmq.DEALER)
            owner.connect(fleet.orchestrator)
            try:
                req = GenerateRequest(session_id="victim-2", prompt_token_ids=prompt, max_new_tokens=3000)
                await owner.send_multipart(pack_frames(req, "victim-2", b"r1"))
                cancel_sent = False
                async with asyncio.timeout(120):  # a hang guard
                    while True:
                        msg = unpack_frames(await owner.recv_multipart()).msg
                        if isinstance(msg, TokenChunk) and not cancel_sent:  # under way: thousands to go
                            await owner.send_multipart(pack_frames(Cancel(session_id="victim-2"), "victim-2", b"r2"))
                            cancel_sent = True
                        if isinstance(msg, GenerateDone):
                            return msg
            finally:
                owner.close(linger=0)
                ctx.term()

        alone, attacked, (first, attacks), cancelled = asyncio.run(run())
        assert attacked.finish_reason == alone.finish_reason != "cancelled"
        assert attacked.token_ids == alone.token_ids
        assert any(attacks), "no Cancel was sent while the session streamed"
        assert isinstance(first.msg, Heartbeat) and first.request_id == b"ping", first  # the Cancels: no answer
        assert cancelled.finish_reason == "cancelled"
        assert "cancel_refused" in fleet.log("orchestrator")
    finally:
        fleet.stop()
