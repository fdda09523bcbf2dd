"""The ``[torchrun]`` table: this node's part of a torchrun launch.

How many nodes and processes per node come from ``[deployment]`` (``num_nodes`` or
``num_train_nodes`` × ``gpus_per_node``; one node: ``num_gpus`` / ``num_train_gpus``); this
table says which node this is and where the nodes meet, with torchrun's own flag names.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from prime_core.config.base import NoSecrets, Section

NETWORK_ENV = ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
               "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_DEBUG", "NCCL_NET", "NCCL_CROSS_NIC")
"""Variables copied from the launching shell into the ranks' environment (and the plan)."""


class TorchrunConfig(Section):
    """Start the trainer (``prime run``) or ``prime sft`` under torchrun on this node."""

    node_rank: int | None = Field(default=None, ge=0)
    """This node's rank (``--node-rank``); defaults to ``$NODE_RANK``, else 0."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of node 0 where the nodes meet (``--rdzv-endpoint``); defaults to
    ``$MASTER_ADDR:$MASTER_PORT``. Required with several nodes."""
    rdzv_backend: str = "static"
    """torchrun's ``--rdzv-backend``: ``static`` keeps ``node_rank`` as given (torchrun's
    default); ``c10d`` lets nodes join in any order (ranks follow arrival)."""
    rdzv_id: str = "prime"
    """``--rdzv-id``: the same on every node of one run."""
    nnodes: int | None = Field(default=None, ge=1)
    """Optional check: must equal the nodes ``[deployment]`` describes."""
    nproc_per_node: int | None = Field(default=None, ge=1)
    """Optional check: must equal the processes per node ``[deployment]`` describes."""
    local_ranks_filter: str | None = "0"
    """Local ranks whose output reaches the console (``--local-ranks-filter``); every rank is
    still logged under ``output_dir/logs/trainer/torchrun/``. ``None``: all ranks."""
    max_restarts: int = Field(default=0, ge=0)
    env: Annotated[dict[str, str], NoSecrets] = Field(default_factory=dict)
    """Extra variables for the ranks (e.g. ``NCCL_SOCKET_IFNAME = "ib0"``)."""

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _ranks(cls, value):
        # `--torchrun.local-ranks-filter 0` arrives as an int, `0,1` as a string or a list.
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            return str(value)
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        return value

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"'{value}' is not HOST:PORT (e.g. 10.0.0.1:29500)")
        return value
