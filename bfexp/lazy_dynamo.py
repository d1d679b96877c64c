"""Moved to bfexp.torch_internals (the one module that touches torch's private names); this name
stays for bfexp.cli's import until that line names bfexp.torch_internals."""

from bfexp.torch_internals import defer_dynamo

__all__ = ["defer_dynamo"]
