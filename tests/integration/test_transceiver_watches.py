"""What each side watches for (transfer/pacing.py): two KvTransceivers in one trio run (real
ZMQ, loopback agent), as in test_transceiver_prepared.py.

ctx watches for gen's REQUEST_DATA from its response (context_first); gen watches for the
notification of a write that ctx said it prepared (WRITE_PREPARED, generation_first). Each watch
ends when what it waits for comes.
"""

from __future__ import annotations

from tests.integration.test_transceiver_prepared import (
    NUM_TOKENS,
    _connect,
    _open_pair,
    _outcome,
    _prepared_early,
    _until,
)
from trtdisagg.transfer.pacing import REQUEST_WATCH_S


async def test_gen_watches_from_ctx_s_word_of_a_prepared_write_until_its_notice() -> None:
    async with _open_pair() as pair:
        pair.gen.stages = []
        key = 2**41 + 9
        await _prepared_early(pair, key, [1, 2, 3])  # ctx sends WRITE_PREPARED as it prepares
        await _until(lambda: pair.gen.statistics().watched == 1, "gen watching")
        assert (key, "prepared_seen") in [(k, stage) for k, stage, _ in pair.gen.stages]
        pair.ctx.respond_and_send_async(key, [[4, 5, 6]], NUM_TOKENS, first_tokens=(3,))
        assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
        assert pair.gen.statistics().watched == 0  # the notice ended the watch


async def test_ctx_watches_from_its_response_until_gen_s_request() -> None:
    async with _open_pair() as pair:
        await _connect(pair)
        key = 2**41 + 10
        pair.ctx.respond_and_send_async(key, [[4, 5, 6]], NUM_TOKENS)
        assert pair.ctx.statistics().watched == 1
        pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [[1, 2, 3]], NUM_TOKENS)
        assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
        assert pair.ctx.statistics().watched == 0  # REQUEST_DATA ended the watch
        assert pair.gen.statistics().watched == 0  # no word of a prepared write: not watched


async def test_the_time_spent_watching_is_counted_and_only_while_spinning_is_allowed() -> None:
    async with _open_pair() as pair:
        await _connect(pair)  # (ctx watched for its request meanwhile)
        before = pair.ctx.statistics().watch_s
        pair.ctx.may_spin = lambda: False  # its executor runs a step throughout
        pair.ctx.respond_and_send_async(2**41 + 11, [[4, 5, 6]], NUM_TOKENS)
        await _until(lambda: pair.ctx.statistics().watched == 0, "the watch running out")
        assert pair.ctx.statistics().watch_s == before  # watched, never spun
        pair.ctx.may_spin = lambda: True
        pair.ctx.respond_and_send_async(2**41 + 12, [[4, 5, 6]], NUM_TOKENS)
        await _until(lambda: pair.ctx.statistics().watched == 0, "the watch running out")
        await _until(lambda: pair.ctx.statistics().watch_s > before, "the spin counted")
        # Nobody asked: the loop spun for the whole watch (REQUEST_WATCH_S), and no longer.
        spun = pair.ctx.statistics().watch_s - before
        assert REQUEST_WATCH_S * 0.9 <= spun <= REQUEST_WATCH_S * 3


async def test_a_cancelled_receive_stops_the_watch_for_its_write() -> None:
    async with _open_pair() as pair:
        key = 2**41 + 13
        await _prepared_early(pair, key, [1, 2, 3])
        await _until(lambda: pair.gen.statistics().watched == 1, "gen watching")
        pair.gen.cancel_request(key)  # ctx answers the CANCEL at once: nothing is in flight
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.cancelled
        assert pair.gen.statistics().watched == 0  # not left to run out (100 ms)
