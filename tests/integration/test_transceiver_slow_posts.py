"""A post that blocks (host memory over TCP fills the socket) runs on the pump's thread, which
polls its write right after: two KvTransceivers in one trio run (real ZMQ, loopback agent)
whose ctx agent calls every post slow."""

from __future__ import annotations

import threading
from typing import Any

import attrs

from tests.transceivers import NUM_TOKENS, open_pair, outcome_of, until
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.runtime.agents.base import XferHandle
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent


@attrs.define(eq=False)
class SlowPostAgent:
    """A loopback agent whose posts are never quick; it records which thread posts, and fails
    the first `failures` posts as a broken connection would."""

    inner: LoopbackAgent
    failures: int = 0
    post_threads: list[str] = attrs.Factory(list)
    loop_thread: int = attrs.Factory(threading.get_ident)

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        return False

    def submit(self, fragments: Fragments, remote: str, notif: bytes, **kw: Any) -> XferHandle:
        self.post_threads.append(threading.current_thread().name)
        assert threading.get_ident() != self.loop_thread, "a slow post ran on the Trio thread"
        if self.failures:
            self.failures -= 1
            raise AgentError("connection reset by peer")
        return self.inner.submit(fragments, remote, notif, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _slow(agents: list[SlowPostAgent], failures: int = 0) -> Any:
    def wrap(agent: LoopbackAgent, _faults: object) -> SlowPostAgent:
        agents.append(SlowPostAgent(agent, failures=failures))
        return agents[-1]

    return wrap


async def test_a_slow_post_runs_on_the_pump_thread_and_lands_exact_bytes() -> None:
    agents: list[SlowPostAgent] = []
    async with open_pair(ctx_agent=_slow(agents)) as pair:
        for key, src, dst in ((2**41 + 1, [1, 2, 3], [4, 5, 6]), (2**41 + 2, [4, 5, 6], [0, 1, 2])):
            assert (await pair.transfer(key, src, dst)).ok
            assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
        assert agents[0].post_threads == ["kv-notification-pump"] * 2
        assert pair.count(2**41 + 1, "ctx", "posted") == 1
        assert pair.ctx.statistics().senders == 0


async def test_a_failed_slow_post_fails_its_transfer_and_the_next_one_lands() -> None:
    agents: list[SlowPostAgent] = []
    async with open_pair(ctx_agent=_slow(agents, failures=1)) as pair:
        key, src, dst = 2**41 + 3, [1, 2, 3], [4, 5, 6]
        pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS)
        pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [dst], NUM_TOKENS)
        sent = await outcome_of(pair.ctx.check_context_transfer_status, key)
        assert not sent.ok and "connection reset by peer" in (sent.error or "")
        received = await outcome_of(pair.gen.check_gen_transfer_status, key)
        assert not received.ok
        assert pair.count(key, "ctx", "posted") == 0

        # The pump lives on, and the agent is free for quick calls again.
        assert (await pair.transfer(2**41 + 4, [5, 6, 7], [0, 1, 2])).ok
        assert pair.gen_blocks([0, 1, 2]) == pair.ctx_blocks([5, 6, 7])
        await until(lambda: pair.ctx_agent.handles == {}, "every handle released")
