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
