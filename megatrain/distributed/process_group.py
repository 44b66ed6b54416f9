"""Joining and leaving a torch.distributed process group: the executors' (data_parallel.py) and the nodes' stores'
(node_exchange.py), each over TCP at a rendezvous address tcp://host:port."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megatrain.config import MegatrainError


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_process_group(backend: str, address: str, rank: int, world: int, timeout_s: float,
                       failure: Callable[[Exception], str]) -> None:
    """Joins the group of `world` processes at `address` as `rank`, leaving any group this process was in first (a
    replacement actor never reuses a process, but a test might). A failed rendezvous raises MegatrainError with
    failure(error): torch's own messages name the rendezvous, not what to do about it."""
    leave_process_group()
    try:
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise MegatrainError(failure(e)) from None


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
