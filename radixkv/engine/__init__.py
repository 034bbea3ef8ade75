"""The engine: what a request passes through between a caller and the model.

```text
  Engine (sync_engine)         AsyncEngine (async_engine)
  blocking calls, the caller   coroutines; the core in a process
  steps under the step lock    of its own (process/) or a thread
            \\                       /
             input_processor: validate, tokenize, salt, sampling params -> Request
                          |
             core (EngineCore.step): inbox -> scheduler (admit, grow, preempt over the
                          |          radix cache and block tables) -> block copies ->
                          |          model runner forward -> sample; overlap runs the
                          |          next step's CPU work while this one's forward is in flight
                          |
             output_processor: tokens -> RequestOutput / StreamDelta / Beam,
                               text by the incremental detokenizer (detokenizer)
                          |
             metrics: counters and histograms, exported by `radixkv.metrics`
```

Each module owns one step of that way; `core` is the only one that touches the scheduler, the
cache and the runner, and both faces share it, so every caller sees the same batching,
caching and failure rules. The public names are imported from `radixkv`
(`from radixkv import Engine, AsyncEngine`); this package imports nothing eagerly, so
`radixkv.cache` and the server's validation stay importable without loading the model stack.
"""
