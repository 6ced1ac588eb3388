"""CompLL: a small compression DSL compiled to a NumPy reference and to kernels.

Stages: ``parse`` (source to IR) → ``check`` (types, shapes, payload layout,
parameters) → ``lower`` → ``schedule`` → ``render`` → ``build``; the reference
interpreter (``compll.interpreter``) is the oracle for every backend, and ``Codec``
runs a program on the data. Set ``HIPRESS_DUMP=parse,check,...`` to print a stage's
output. Nothing here imports the engine (``casync``) or the facade (``hipress``).
"""

from .codec import MAX_ELEMENTS, TARGETS, Codec, codec
from .compiler import algorithm_path, algorithms, load, load_source
from .parallelism import threads

__all__ = ["Codec", "codec", "algorithms", "algorithm_path", "load", "load_source",
           "MAX_ELEMENTS", "TARGETS", "threads"]
