"""CuTe layouts of cute-ep's buffers.

Every buffer a kernel touches is described here once, as a layout (`layouts.algebra.Layout`, a
plain-Python mirror of a CuTe layout that becomes a `cute.Layout` via `to_cute()` inside a
kernel). Kernels, the build's manifest, the runtime's buffer sizing and the tests all derive their
shapes, offsets and byte sizes from these functions. Importing this package needs no DSL.
"""

from layouts.algebra import Layout, align_up, ceil_div, make_layout, tile_to_shape
from layouts.buffers import EPConfig, buffer_sizes, dispatch_outputs, dispatch_rows
from layouts.formats import FORMATS, message_layout, token_format
from layouts.scales import expert_scale_blocks, scale_layout
from layouts.swiglu import swiglu_views
from layouts.vectors import VECTOR_BYTES, byte_vectors

__all__ = [
    "EPConfig", "FORMATS", "Layout", "VECTOR_BYTES", "align_up", "buffer_sizes", "byte_vectors",
    "ceil_div", "dispatch_outputs", "dispatch_rows", "expert_scale_blocks", "make_layout",
    "message_layout", "scale_layout", "swiglu_views", "tile_to_shape", "token_format",
]
