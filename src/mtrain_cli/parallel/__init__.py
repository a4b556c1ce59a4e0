"""Where a process sits in a parallel run, as values: its ranks and mesh (context.py), the context-parallel ring of
one sequence and its process groups (topology.py), and which tokens of a sequence each ring rank holds
(layouts.py). Ring attention (attention/ring/) runs over these; train/distributed.py sets them up from the config.

This is the package's public face; other packages import from here. It reads no config.
"""

from mtrain_cli.parallel.context import ContextParallel, ParallelContext
from mtrain_cli.parallel.layouts import TokenLayout, shard_batch
from mtrain_cli.parallel.topology import RingTopology, build_topology

__all__ = [
    "ContextParallel",
    "ParallelContext",
    "RingTopology",
    "TokenLayout",
    "build_topology",
    "shard_batch",
]
