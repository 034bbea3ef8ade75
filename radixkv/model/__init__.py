"""The model side: loading a checkpoint or preset with its tokenizer, the KV tensors and the
forward pass over them (`runner`, with attention swapped for the paged kernels by
`attention_backend`), and sampling the next token from the logits (`sampler`)."""
