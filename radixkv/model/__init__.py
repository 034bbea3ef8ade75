"""The model side: loading a checkpoint or preset with its tokenizer, the KV tensors and the
forward pass over them (`runner`, with attention swapped for the paged kernels by
`attention_backend`): chunks of sequences in (`radixkv.scheduler.chunk`), logits out. The next
token is chosen from them in `radixkv.sampling`."""
