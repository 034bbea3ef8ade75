"""The communicator of one tensor-parallel engine: a process group over its ranks and nothing else.

The group is built from the backend class directly (`ProcessGroupGloo` on the CPU,
`ProcessGroupNCCL` on CUDA) over a `TCPStore` that rank 0 opens on a free port, rather than
through `torch.distributed.init_process_group`: that one is a per-process global, and rank 0 is
the user's process, which may hold several engines (and its own distributed job). Every
collective waits at most `timeout`, so a rank that stops answering fails the step instead of
hanging it; a rank that dies closes its sockets, which gloo reports at once.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as Communicator  # what ProcessGroupGloo/NCCL derive from

from radixkv.model.tensor_parallel import AllReduce

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # ranks run in lockstep; this only bounds a stalled one
HOST = "127.0.0.1"  # all ranks run on this machine


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of the loopback (`store.port`)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)


def connect(store: dist.Store | int, rank: int, size: int, device: torch.device) -> Communicator:
    """Joins the group (blocks until every rank has joined). `store` is rank 0's own store, or on
    a worker the port of rank 0's."""
    if isinstance(store, int):
        store = dist.TCPStore(HOST, store, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store = dist.PrefixStore("radixkv-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)


def all_reducer(group: Communicator) -> AllReduce:
    """A function that sums a tensor over the group's ranks in place (the rowwise layers' hook)."""

    def all_reduce(tensor: torch.Tensor) -> None:
        group.allreduce([tensor]).wait()

    return all_reduce


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: `cuda:<rank>` when the engine runs on CUDA, else the CPU."""
    return torch.device("cuda", rank) if torch.device(device).type == "cuda" else torch.device("cpu")


def check_devices(device: str, size: int) -> None:
    """ValueError when `size` ranks cannot each have their own device."""
    kind = torch.device(device).type
    if kind == "cuda":
        count = torch.cuda.device_count()
        if size > count:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} CUDA devices, but {count} are visible"
            )
    elif kind != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda or cpu, not {device!r}")
