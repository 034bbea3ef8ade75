"""radixkv: an LLM inference engine that never computes the same prefix twice.

Paged KV blocks (as in vLLM's PagedAttention) under a radix tree of token prefixes (as in
SGLang's RadixAttention), with token-granular prefix hits, copy-on-write block sharing, beam
search inside the engine and a replay tool that measures time to first token.
"""

__version__ = "0.1.0"
