"""CuTe DSL kernel sources and the ahead-of-time build that compiles them into cubins.

Importing this package needs the DSL (`pip install cute-ep[build]`); the runtime in `cute_ep`
never imports it.
"""
