"""``from bfexp.bluefog.common import topology_util``, as ``from bluefog.common import topology_util``."""

from bfexp.bluefog import topology_util

__all__ = ["topology_util"]
