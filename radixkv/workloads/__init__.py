"""Workloads to replay and simulate: the JSONL workload file (`format`), seeded synthetic
generators (`generate`), readers of public hash-id traces (`traces`) and converters from those
traces and from ShareGPT text (`convert`), and the `radixkv workload` subcommands (`commands`)."""
