"""Plain-torch references, written independently of the kernels, that the tests and the demo
compare against: dispatch / combine and FP8 blockwise quantization (`ep`), the FP4 formats
(`fp4`) and the fused SwiGLU family (`silu`)."""
