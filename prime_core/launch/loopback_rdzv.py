"""torchrun's rendezvous for the processes of one machine, listening on loopback only.

``torchrun --standalone`` hosts its store (the rendezvous, and the ranks' process-group store)
on a TCP port of every interface: anyone on the network can reach it for the life of the
run. This handler, registered with torchrun as ``prime-loopback`` (the ``torchrun.handlers``
entry point of prime-core), hosts that one store on a socket bound to 127.0.0.1 and hands it
to the ranks (``use_agent_store``), so that nothing a one-node run starts listens beyond this
machine::

    torchrun --nnodes 1 --rdzv-backend prime-loopback --rdzv-endpoint 127.0.0.1:0 --nproc-per-node N ...
"""

from __future__ import annotations

import datetime
import socket

NAME = "prime-loopback"
LOOPBACK = "127.0.0.1"
ARGS = ["--nnodes", "1", "--rdzv-backend", NAME, "--rdzv-endpoint", f"{LOOPBACK}:0", "--rdzv-id", "prime"]
"""torchrun's flags for a one-node run through this handler (instead of ``--standalone``)."""


def loopback_store(timeout: float):
    """A ``TCPStore`` hosted in this process on a socket bound to 127.0.0.1 (any free port), for
    ranks to meet at as clients (``TORCHELASTIC_USE_AGENT_STORE``): the store, which owns the
    socket from then on (closed with it), and its port."""
    from torch.distributed import TCPStore

    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((LOOPBACK, 0))
    listening.listen(128)
    port = listening.getsockname()[1]
    store = TCPStore(LOOPBACK, port, 1, True, datetime.timedelta(seconds=timeout), multi_tenant=True,
                     master_listen_fd=listening.fileno(), use_libuv=False)
    listening.detach()
    return store, port


def handler():
    """The ``torchrun.handlers`` entry point: torchrun calls it for the handler's factory."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class LoopbackRendezvous(RendezvousHandler):
        def __init__(self, run_id: str, timeout: float) -> None:
            self.run_id = run_id
            self.timeout = datetime.timedelta(seconds=timeout)
            self._store = None
            self._port = 0

        def get_backend(self) -> str:
            return NAME

        @property
        def use_agent_store(self) -> bool:
            return True  # the ranks use this store: no second one is hosted

        def next_rendezvous(self):
            from torch.distributed import PrefixStore

            if self._store is None:
                self._store, self._port = loopback_store(self.timeout.total_seconds())
            return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1,
                                  RendezvousStoreInfo(LOOPBACK, self._port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    def create(params):
        if params.max_nodes != 1:
            raise ValueError(f"the {NAME} rendezvous is for one node (--nnodes 1), not {params.max_nodes}")
        return LoopbackRendezvous(params.run_id, float(params.config.get("timeout", 600)))

    return create
