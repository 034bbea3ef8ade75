"""`radixkv serve`: an OpenAI-compatible HTTP server over `AsyncEngine`.

One concern per module, in the order a request meets them: `app` (routes, auth, error shapes),
`protocol` (the request bodies, strict types), `handlers` (a body to a response, SSE included),
`chat_prompt` (chat template with earlier replies' ids spliced in), `params` (a body to engine
params), `state` (admission and the reply store's home), `generation` (engine calls, merged
streams), `responses` (OpenAI's response bodies), `errors`, `prometheus` (`/metrics`), and
`launch` (the command). Nothing here is imported by `radixkv --help`.
"""
