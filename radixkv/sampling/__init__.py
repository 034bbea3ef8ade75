"""The next token from a step's logits: the sampler (greedy, temperature, top-k, top-p, seeded
draws, logprob records) and the logits processors of `SamplingParams` it applies first.

Its own room, between the scheduler and the model: the model runner returns logits, and the
scheduler's `postprocess` turns them into tokens through here, so neither imports the other.
"""
