"""Where a process sits in a parallel run, as values: its ranks and mesh (context.py), the context-parallel ring of
one sequence and its process groups (topology.py), which tokens of a sequence each ring rank holds (layouts.py),
and what a ring needs of its sizes (sizes.py). Ring attention (attention/ring/) runs over these;
train/distributed.py sets them up from the config.

This is the package's public face; other packages import from here, and `sizes` directly, which config reads
before torch loads. Names resolve on first use: importing the face loads no torch. It reads no config.
"""

from mtrain_cli.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "context": ("ContextParallel", "ParallelContext"),
        "layouts": ("TokenLayout", "shard_batch"),
        "topology": ("RingTopology", "build_topology"),
        "sizes": ("layout_unit", "local_node_size", "splits_into_nodes"),
    },
)
