"""Where the AOT kernel library lives and how to read its manifest. No CUDA, no DSL."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from layouts.abi import MANIFEST, MANIFEST_FORMAT, KernelSpec, default_library_dir, library_dir

__all__ = ["Entry", "KernelNotBuilt", "Manifest", "build_command", "library_dir"]


def build_command(directory: Path) -> str:
    """The command that (re)builds the library at `directory`."""
    if directory.resolve() == default_library_dir():
        return "cute-ep build"
    return f"cute-ep build --out {directory}"


class KernelNotBuilt(LookupError):
    """The library has no cubin for this configuration and architecture."""


@dataclass(frozen=True)
class Entry:
    """One compiled kernel in the manifest."""

    spec: KernelSpec
    arch: str
    symbol: str
    cubin: Path
    sha256: str
    # The cubin calls NVSHMEM: the version of the NVSHMEM device library linked into it (the
    # host library that initialises its module after it loads must be the same version,
    # `cute_ep.runtime.nvshmem`); None for every other kernel.
    nvshmem: str | None = None

    @property
    def key(self) -> str:
        return self.spec.key


class Manifest:
    def __init__(self, directory: Path, data: dict):
        self.directory = directory
        self.data = data
        self.entries: dict[tuple[str, str], Entry] = {}
        for e in data["kernels"]:
            spec = KernelSpec.from_json(e["spec"])
            self.entries[(spec.key, e["arch"])] = Entry(
                spec=spec, arch=e["arch"], symbol=e["symbol"],
                cubin=directory / e["cubin"], sha256=e["sha256"],
                nvshmem=e.get("nvshmem") or None)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Manifest":
        directory = library_dir(path)
        file = directory / MANIFEST
        if not file.is_file():
            raise KernelNotBuilt(
                f"no kernel library at {directory} (no {MANIFEST}); build it with "
                f"`{build_command(directory)}`")
        data = json.loads(file.read_text())
        if data.get("format") != MANIFEST_FORMAT:
            raise KernelNotBuilt(
                f"{file} has manifest format {data.get('format')}, this cute-ep reads "
                f"{MANIFEST_FORMAT}; rebuild it with `{build_command(directory)}`")
        return cls(directory, data)

    def lookup(self, key: str, arch: str) -> Entry:
        entry = self.entries.get((key, arch))
        if entry is None:
            have = sorted({k for k, a in self.entries if a == arch})
            raise KernelNotBuilt(
                f"kernel config {key} for {arch} is not in the library at {self.directory} "
                f"({len(have)} configs built for {arch}); build it with "
                f"`{build_command(self.directory)}`")
        return entry

    def select(self, family: str, arch: str, **fields) -> Entry:
        """The one entry of `family` for `arch` whose config has `fields`.

        Callers name what changes the result (e.g. exclusive=True); the build matrix chooses
        tuning parameters such as thread counts.
        """
        found = [e for (_, a), e in self.entries.items() if a == arch and e.spec.family == family
                 and all(e.spec.config.get(k) == v for k, v in fields.items())]
        if len(found) == 1:
            return found[0]
        what = f"{family} with {fields or 'any config'} for {arch}"
        if not found:
            raise KernelNotBuilt(f"kernel config {what} is not in the library at "
                                 f"{self.directory}; build it with `{build_command(self.directory)}`")
        raise LookupError(f"the library at {self.directory} has {len(found)} configs of {what}: "
                          f"{sorted(e.key for e in found)}; name one by its key")

    def arches(self) -> list[str]:
        return sorted({a for _, a in self.entries})
