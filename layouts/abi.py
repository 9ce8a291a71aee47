"""The contract between the AOT build (`kernels/`) and the runtime (`cute_ep/`).

It lives on the ground floor that both stand on: importing it loads only `layouts`' plain-Python
modules (no DSL, no torch, no CUDA), so defining or building a kernel never imports the runtime.

A kernel's parameters are flat: device pointers and 32/64-bit integers, nothing else. That
keeps the ABI a list of fixed-size slots the runtime can pack without knowing how the DSL
lowers richer types, and the build checks the compiled PTX signature against it.

Both sides describe a kernel with the same `KernelSpec`; the build writes it into
`manifest.json`, the runtime reads it back and checks every launch against it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path

from layouts.buffers import ELEMENT_BYTES

# Scalar kinds and their byte sizes in the kernel parameter buffer.
SCALAR_SIZES = {"i32": 4, "i64": 8}
POINTER_SIZE = 8

# Element types a pointer parameter may carry (torch's names), with their byte sizes.
ELEMENT_SIZES = ELEMENT_BYTES

ARCHES = ("sm_90a", "sm_100a")

# The library folder: cubins under <arch>/ and this manifest, which the build writes and the
# runtime reads; the format number changes whenever either side's reading of it would.
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LIBRARY_ENV_VAR = "CUTE_EP_LIBRARY"


def default_library_dir() -> Path:
    """`_library` inside the installed `cute_ep` package, found without importing it."""
    spec = find_spec("cute_ep")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the cute_ep package is not importable; pass the library "
                                  f"folder explicitly or set ${LIBRARY_ENV_VAR}")
    return Path(spec.submodule_search_locations[0]).resolve() / "_library"


def library_dir(path: str | os.PathLike | None = None) -> Path:
    """The library folder: an explicit path, else $CUTE_EP_LIBRARY, else the package's own."""
    if path is not None:
        return Path(path)
    return Path(os.environ.get(LIBRARY_ENV_VAR) or default_library_dir())


@dataclass(frozen=True)
class Param:
    """One kernel parameter.

    kind: "ptr" (a device pointer to `dtype` elements) or a scalar kind from SCALAR_SIZES.
    align: the byte alignment the kernel assumes for a pointer (it emits vector accesses).
    min_elements: for a pointer, the tensor must hold at least `scalar * factor` elements,
      given as (scalar parameter name, factor); checked before every launch.
    writes: the kernel writes through this pointer.
    """

    name: str
    kind: str
    dtype: str | None = None
    align: int = 1
    min_elements: tuple[str, int] | None = None
    writes: bool = False

    @property
    def size(self) -> int:
        return POINTER_SIZE if self.kind == "ptr" else SCALAR_SIZES[self.kind]

    def __post_init__(self):
        if self.kind == "ptr":
            if self.dtype not in ELEMENT_SIZES:
                raise ValueError(f"parameter {self.name}: unknown element type {self.dtype!r}")
        elif self.kind not in SCALAR_SIZES:
            raise ValueError(f"parameter {self.name}: unknown kind {self.kind!r}")


@dataclass(frozen=True)
class GridRule:
    """One grid dimension: `ceil(scalar / divisor)` clamped to [0, max], or a constant.

    The runtime evaluates it from the launch's scalar arguments; a zero dimension means there
    is nothing to do and the launch is skipped.
    """

    constant: int | None = None
    ceil_div: tuple[str, int] | None = None
    max: int | None = None

    def evaluate(self, scalars: dict[str, int]) -> int:
        if self.constant is not None:
            return self.constant
        name, divisor = self.ceil_div
        value = -(-scalars[name] // divisor)
        return min(value, self.max) if self.max is not None else value


@dataclass(frozen=True)
class KernelSpec:
    """What the runtime needs to launch one compiled kernel configuration."""

    family: str
    config: dict
    params: tuple[Param, ...]
    block: tuple[int, int, int]
    grid: tuple[GridRule, GridRule, GridRule]
    smem_bytes: int = 0
    sizes: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return config_key(self.family, self.config)

    def to_json(self) -> dict:
        out = asdict(self)
        out["key"] = self.key
        return out

    @staticmethod
    def from_json(d: dict) -> "KernelSpec":
        params = tuple(
            Param(**{**p, "min_elements": tuple(p["min_elements"]) if p["min_elements"] else None})
            for p in d["params"]
        )
        grid = tuple(
            GridRule(
                constant=g["constant"],
                ceil_div=tuple(g["ceil_div"]) if g["ceil_div"] else None,
                max=g["max"],
            )
            for g in d["grid"]
        )
        return KernelSpec(
            family=d["family"],
            config=d["config"],
            params=params,
            block=tuple(d["block"]),
            grid=grid,
            smem_bytes=d["smem_bytes"],
            sizes=d.get("sizes", {}),
        )


def config_key(family: str, config: dict) -> str:
    """The stable name of a compiled configuration, e.g. `block_prefix_sum[exclusive=1,threads=512]`."""
    inner = ",".join(f"{k}={_canonical(v)}" for k, v in sorted(config.items()))
    return f"{family}[{inner}]"


def _canonical(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    return str(v)
