"""`radixkv serve`: an OpenAI-compatible HTTP server over `AsyncEngine`.

One concern per module, in the order a request meets them: `app` (the door: routes, keys,
parsing, the model and the cache namespace, error shapes), `protocol` (the request bodies, strict
types, their checks run as they parse), `handlers` (a checked body to a response, SSE included),
`engine_inputs` (a body to the engine's inputs in one pass: prompts, params, grammars),
`chat_prompt` (the chat template, with earlier replies' ids spliced in), `state` (admission and
the reply store's home), `sessions`, `generation` (engine calls, merged streams), `responses`
(OpenAI's response bodies, made after the engine call), `tools` (tool calls out of replies),
`responses_api` (`/v1/responses` over the chat path), `dashboard_routes` (`/dashboard`),
`errors`, `prometheus` (`/metrics`), and `launch` (the command). Nothing here is imported by
`radixkv --help`.

A chat body walks the server from `handlers.create` to its engine call in 10 stays in 6 modules
(`tests/test_server_request_path.py`).
"""
