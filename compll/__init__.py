"""CompLL: a small compression DSL compiled to a NumPy reference and to kernels.

Stages: ``parse`` (source to IR) → ``check`` (types, shapes, payload layout,
parameters) → the reference interpreter (``compll.interpreter``), the oracle for every
backend. Set ``HIPRESS_DUMP=parse,check`` to print a stage's output.
"""

from .compiler import algorithm_path, algorithms, load, load_source

__all__ = ["algorithms", "algorithm_path", "load", "load_source"]
