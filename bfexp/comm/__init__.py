"""Communication engines behind one contract (engine.Engine)."""

from bfexp.comm.engine import CommError, Engine, Handle

__all__ = ["CommError", "Engine", "Handle"]
