"""The worker's HTTP API in front processes (`api_server_count >= 1`), the engine in its own.

  supervisor  the engine process's side: private link directory, spawn, watch and stop fronts
  server      engine side of the link: fronts' messages → Executor calls, outputs in batches
  process     a front process: the usual Quart app and WorkerService over a RemoteEngine
  client      RemoteEngine: the `http.engine.Engine` a front has
  wire        the messages and their msgpack encoding (outputs as flat arrays)
  link        one zmq socket driven under Trio

The fronts take HTTP, tokenizing and the SSE writes off the engine process's GIL.
"""
