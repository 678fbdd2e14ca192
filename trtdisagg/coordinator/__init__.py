"""The coordinator: the OpenAI front end that splits requests into ctx and gen legs.

Entry points: `config.load_coordinator_config(path, overrides)`, `serve.run_coordinator(config)`
(sync, handles fleet mode) and `serve.serve_coordinator(config, task_status=...)` (a Trio
service). Layout, pure modules marked ◆:

  config ◆       disagg.yaml → CoordinatorConfig, key-path errors
  routers/ ◆     round_robin, load_balancing, kv_cache_aware, conversation
  split ◆        ctx/gen request bodies, answer merging
  ledger ◆       what an answer told the client, choice by choice; gen's events rewritten
  continuation ◆ the request that resumes an answer on another gen; the text state carried
  perf ◆         per-request phase timings
  cluster ◆      server health and server_info
  placement      Placement interface and Lease (one reservation)
  local          LocalPlacement: health checks, routers, KV event polling in this process,
                 servers from the url lists or from the etcd membership watch
  service        DisaggService: one request through its legs, retries, deadlines
  gen_legs       an answer's gen legs: the first opened, continuations (migration)
  choices        a batch of prompts: one ctx → gen pair each, answers merged
  resume         GenRelay: gen legs read within their deadlines, resumed when one fails
  relay          streaming bodies (gen's SSE relayed as it arrives)
  upstream       the httpx client and typed upstream errors
  prompts        prompt token ids at the coordinator (the workers' tokenizer)
  app            HTTP routes of the front end
  serve, fleet   services, process entry points, the SO_REUSEPORT fleet supervisor
"""
