"""Packaging hook (`[tool.setuptools.cmdclass]` in pyproject.toml): a wheel carries exactly the
cubins its library's manifest lists. Plain Python: building a wheel needs no DSL.

setuptools stages package files in `build/lib` and never empties it, so a tree that built a
wheel before would also ship the cubins of that earlier library (dead weight the runtime never
loads). After staging, the cubins the staged manifest does not list are removed.
"""

import json
from pathlib import Path

from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self):
        super().run()
        library = Path(self.build_lib, "cute_ep", "_library")
        manifest = library / "manifest.json"
        if not manifest.exists():
            return
        listed = {entry["cubin"] for entry in json.loads(manifest.read_text())["kernels"]}
        for cubin in library.glob("*/*.cubin"):
            if cubin.relative_to(library).as_posix() not in listed:
                cubin.unlink()
