"""What a context-parallel ring needs of its sizes, as rules asked wherever they are checked or used (config
checks, the token layouts, `mtrain profile ring`, the launch): a sequence in whole layout units, a ring in whole
nodes. Torch-free: config checks a recipe with it before torch loads."""

from __future__ import annotations

import os


def layout_unit(layout: str, num_ranks: int, block: int) -> int:
    """The token count a sequence length must be a multiple of for `layout` over `num_ranks` ranks: whole blocks
    per rank (stripe), whole blocks per chunk of the 2 × num_ranks (zigzag)."""
    return num_ranks * block * (2 if layout == "zigzag" else 1)


def local_node_size(node_size: int | None, world: int) -> int:
    """Ranks per node of a hierarchical ring: the one given, else the launcher's ranks per node."""
    return node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))


def splits_into_nodes(num_ranks: int, node_size: int) -> bool:
    """Whether a ring of `num_ranks` splits into 2 or more nodes of `node_size` ranks (inner and outer rings)."""
    return num_ranks % node_size == 0 and node_size < num_ranks
