"""Triton kernels. Each subpackage is one op: the public op that validates and dispatches, the plain-torch
reference beside it and the Triton implementation (``kernel``).
"""
