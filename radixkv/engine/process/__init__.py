"""The engine core in a process of its own, as vLLM's EngineCore and SGLang's scheduler run.

The front end (`AsyncEngine` and the HTTP server, in the caller's process) validates, tokenizes,
detokenizes and streams; the core process (`core_process`) owns the scheduler, the KV cache, the
model runner and its tensor-parallel workers, and steps. They talk over ZeroMQ with msgspec
messages (`messages`): requests, aborts and session closes one way; one message per step, with
every request's new tokens, the other way; control calls (metrics, invariant checks) on a
request/reply socket of their own. `core_client.CoreClient` is the front end's side;
`launcher` forks each core from a process that has imported the engine once.

Why: the front end's per-token work (text, JSON, SSE) then never holds the step's interpreter
lock, and a crash of the core is a clean error for every open request rather than a server half
alive: the front end watches the process and fails everything at once when it dies.
"""
