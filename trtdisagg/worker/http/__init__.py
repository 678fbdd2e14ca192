"""The worker's HTTP edge: OpenAI requests in, executor requests submitted, JSON or SSE out.

  app            create_app: the quart-trio routes, errors as OpenAI error bodies
  service        WorkerService: tokenising, checks, one executor request per choice
  jobs           ChoiceRun, Job, MergedBody: a request's choices read whole or as one stream
  responses      whole bodies and streamed chunks for completions and chat
  gen_source     what a generation_only request carries from ctx's answer, checked
  handoff    ◆   ctx's instance name in `disaggregated_params.opaque_state`

◆: pure (imports no torch, trio or sockets). The engine these call is `trtdisagg.worker.engine`;
`trtdisagg.worker.serve` starts the process and serves `app` with hypercorn.
"""
