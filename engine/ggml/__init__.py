"""ggml through cffi: the raw binding (``ffi``, ``lib``, ``ops``) and a thin typed layer.

Graph code calls ``lib.ggml_*`` directly on ``Tensor`` pointers; this package only adds what
every caller would otherwise repeat: contexts for graph metadata, numpy <-> ggml type and shape
mapping, and names.
"""

from engine.ggml.graph import Graph, Tensor, ggml_type_of, numpy_dtype_of, shape_of
from engine.ggml.native import NULL, ffi, lib, native_info, ops

__all__ = [
    "NULL",
    "Graph",
    "Tensor",
    "ffi",
    "ggml_type_of",
    "lib",
    "native_info",
    "numpy_dtype_of",
    "ops",
    "shape_of",
]
