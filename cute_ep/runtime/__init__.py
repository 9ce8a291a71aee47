"""The runtime: the kernel library's manifest (`library`), loading cubins and launching them on
torch tensors (`launch`), and the peer-mapped memory and config agreement of an EP group
(`comm`). Needs torch and cuda-python, never the DSL."""
