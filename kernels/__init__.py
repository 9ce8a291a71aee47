"""CuTe DSL kernel sources and the ahead-of-time build that compiles them into cubins.

Its kernel modules need the DSL (`pip install cute-ep[build]`), except `wheel.py`, the wheel's
packaging hook; the runtime in `cute_ep` never imports this package.
"""
