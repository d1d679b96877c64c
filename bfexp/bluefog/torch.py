"""``import bfexp.bluefog.torch as bf``: the same names as bfexp.bluefog, where BlueFog keeps them."""

from bfexp.bluefog import *  # noqa: F403 - this module is that namespace under BlueFog's path
from bfexp.bluefog import __all__  # noqa: F401
