"""The worker's engine: requests in, a step loop over the model, outputs and KV transfers out.

  executor       Executor: what the HTTP side calls (submit, abort, release, queries)
  loop           StepLoop: admit → poll → receive → schedule → step → respond, one rank or many
  ports      ◆   the engine's edges: StepDriver, TransferPort, the Transceiver calls it makes
  local          LocalDriver: one rank, each forward in a worker thread
  host_stream    HostStream: a CPU rank's steps, computed in order on one thread
  multi_rank     MultiRankDriver: rank 0 ticks every rank (the followers are ../ranks.py)
  tracker    ◆   TransferTracker: the transfer containers; outcomes → scheduler calls
  outputs    ◆   OutputProcessor: detokenizing, stop rules, timings, RequestOutput
  ending     ◆   Ending: how a request ends, as data
  live           Live (a request inside the engine), Inbox (the handlers' commands)
  wakeup         Wakeup: the loop's wake-up, made before whatever wakes it
  build          build_worker: every part constructed once, in order
  test_hooks     test-only wrappers (KV digests, failed steps), built only when enabled

◆: pure (no torch, trio or sockets). The scheduler, request, runner and sampling modules the
engine drives are in `trtdisagg.worker`.
"""
