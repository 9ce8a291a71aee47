"""Load AOT-compiled cubins with the CUDA driver API and launch them on torch tensors.

Never imports the DSL. A module is loaded once per process and device, a kernel is looked up by
its config key, its arguments are checked against the manifest's parameter ABI before every
launch, and launches go to torch's current stream (so they are captured by `torch.cuda.graph`).
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading

import torch

from cute_ep.runtime.library import Entry, Manifest
from layouts.abi import KernelSpec

try:  # cuda-python >= 12.6 ships the driver bindings as cuda.bindings
    from cuda.bindings import driver
except ImportError:  # pragma: no cover - older cuda-python layout
    from cuda import cuda as driver

ARCH_OF_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
_INT_RANGES = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1)}
# Grids a bound launcher remembers by the values of the scalars they depend on, at most (a token
# count takes up to max_tokens values; past this many the memory is dropped and refilled).
_GRIDS_REMEMBERED = 4096
_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64}


class CudaError(RuntimeError):
    pass


_LAUNCH = None


def _launcher():
    """`cuLaunchKernel` of the driver library torch and cuda-python already loaded, called
    through ctypes, bound on first use (a machine without a GPU never needs it). Its arguments
    are plain values (a kernel's `CUfunction` and a stream as their handles), which spares each
    launch cuda-python's wrapping of every argument (a few microseconds of a dispatch's host
    time); and it is declared without `argtypes`, whose conversion of all eleven costs about a
    microsecond more: `_launch_kernel` passes the handles as `ctypes.c_void_p` and the sizes as
    ints below 2**32, which ctypes passes as the C ints `unsigned int` parameters take."""
    global _LAUNCH
    if _LAUNCH is None:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        launch.restype = ctypes.c_int
        _LAUNCH = launch
    return _LAUNCH


def _launch_kernel(function: ctypes.c_void_p, grid, tail: tuple, stream: int,
                   argv: ctypes.c_void_p) -> None:
    """Launch `function` (a CUfunction handle) on `grid` (from `_launch_grid`), `tail` = (block
    x, y, z, dynamic shared memory bytes), with the kernel parameter array at `argv` on `stream`
    (a raw handle as an int); raise CudaError with the driver's words."""
    err = (_LAUNCH or _launcher())(function, *grid, *tail, ctypes.c_void_p(stream), argv, None)
    if err:
        check(driver.CUresult(err))


class _AccessPolicyWindow(ctypes.Structure):
    """`CUaccessPolicyWindow`."""
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hit_ratio", ctypes.c_float), ("hit_prop", ctypes.c_int),
                ("miss_prop", ctypes.c_int)]


class _LaunchAttributeValue(ctypes.Union):
    """`CUlaunchAttributeValue` (64 bytes), its access policy window member only."""
    _fields_ = [("pad", ctypes.c_char * 64), ("window", _AccessPolicyWindow)]


class _LaunchAttribute(ctypes.Structure):
    """`CUlaunchAttribute`: the id, padded to 8 bytes, then the value."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    """`CUlaunchConfig`."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_ACCESS_POLICY_WINDOW = 1  # CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
_ACCESS_PROPERTY_STREAMING = 1  # CU_ACCESS_PROPERTY_STREAMING
_LAUNCH_EX = None


def _launch_kernel_streaming(function: ctypes.c_void_p, grid, tail: tuple, stream: int,
                             argv: ctypes.c_void_p, window: tuple[int, int]) -> None:
    """`_launch_kernel` by `cuLaunchKernelEx` with an L2 access policy window: the `window`
    (address, bytes) read with the streaming property (its lines the first to leave L2), hits
    and misses alike, for this launch only (graph capture records it with the kernel)."""
    global _LAUNCH_EX
    if _LAUNCH_EX is None:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        launch.restype = ctypes.c_int
        _LAUNCH_EX = launch
    attr = _LaunchAttribute(id=_ACCESS_POLICY_WINDOW)
    attr.value.window = _AccessPolicyWindow(window[0], window[1], 1.0,
                                            _ACCESS_PROPERTY_STREAMING,
                                            _ACCESS_PROPERTY_STREAMING)
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*tail[:3]), tail[3],
                           ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
    err = _LAUNCH_EX(ctypes.byref(config), function, argv, None)
    if err:
        check(driver.CUresult(err))


def _launch_grid(key: str, grid) -> tuple[int, int, int]:
    """`grid` as the tuple `_launch_kernel` takes, refused if a dimension does not fit the
    driver's unsigned int (ctypes would pass its low 32 bits, not raise)."""
    if any(dim >> 32 for dim in grid):
        raise ValueError(f"{key}: launch grid {tuple(grid)} does not fit 32-bit dimensions")
    return tuple(grid)


def check(result):
    """Unwrap a cuda-python driver call's (error, *values) tuple, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        raise CudaError(f"{name.decode() if name else err}: {text.decode() if text else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_arch(device: torch.device) -> str:
    """The library architecture that runs on `device` (sm_90a for Hopper, sm_100a for Blackwell)."""
    cap = torch.cuda.get_device_capability(device)
    arch = ARCH_OF_CAPABILITY.get(cap)
    if arch is None:
        raise RuntimeError(
            f"{torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) is not "
            f"supported: cute-ep runs on {', '.join(ARCH_OF_CAPABILITY.values())}")
    return arch


class Kernel:
    """One compiled kernel loaded on one device."""

    def __init__(self, entry: Entry, function, device_index: int):
        self.entry = entry
        self.spec: KernelSpec = entry.spec
        self.function = function
        # The CUfunction for _launch_kernel (None: a kernel that is never launched).
        self._handle = ctypes.c_void_p(int(function)) if function is not None else None
        self._tail = (*self.spec.block, self.spec.smem_bytes)  # block and shared memory
        self.device_index = device_index
        self._is_ptr = tuple(p.kind == "ptr" for p in self.spec.params)
        # Parameter storage and the void** array pointing into it, built once and refilled per
        # launch: cuLaunchKernel copies the values, so reuse is safe (also under graph capture).
        self._slots = [_CTYPES[p.kind]() for p in self.spec.params]
        self._argv = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.addressof(s) for s in self._slots])
        self._argv_address = ctypes.c_void_p(ctypes.addressof(self._argv))
        self._lock = threading.Lock()
        self._resident: int | None = None
        # Per pointer parameter, what check_args checks: (index, error name, dtype, alignment,
        # min_elements), worked out once.
        key = self.spec.key
        self._pointer_checks = tuple(
            (i, f"{key}: {p.name}", _torch_dtype(p.dtype), p.align, p.min_elements)
            for i, p in enumerate(self.spec.params) if p.kind == "ptr")

    def resident_ctas(self) -> int:
        """CTAs of this kernel one SM holds at once (registers, shared memory and threads, as
        the driver computes them): a persistent grid's CTAs per SM."""
        if self._resident is None:
            self._resident = max(1, check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.function, self.spec.block[0] * self.spec.block[1] * self.spec.block[2],
                self.spec.smem_bytes)))
        return self._resident

    def check_args(self, args) -> dict[str, int]:
        """Validate launch arguments against the manifest's ABI; returns the scalar values."""
        spec = self.spec
        if len(args) != len(spec.params):
            raise TypeError(f"{spec.key} takes {len(spec.params)} arguments "
                            f"({', '.join(p.name for p in spec.params)}), got {len(args)}")
        scalars = {}
        for p, a in zip(spec.params, args):
            if p.kind != "ptr":
                _check_scalar(spec, p, a)
                scalars[p.name] = a
        for i, name, dtype, align, min_elements in self._pointer_checks:
            a = args[i]
            check_tensor(a, name=name, dtype=dtype, align=align, device_index=self.device_index)
            if min_elements:
                scalar, factor = min_elements
                need = scalars[scalar] * factor
                if a.numel() < need:
                    raise ValueError(f"{spec.key}: {spec.params[i].name} holds {a.numel()} "
                                     f"elements, {scalar}={scalars[scalar]} needs {need}")
        return scalars

    def launch(self, *args) -> None:
        self._launch(args, self._grid(self.check_args(args)))

    def launch_checked_by_caller(self, *args, stream_window: tuple[int, int] | None = None
                                 ) -> None:
        """`launch` without `check_args`, for a caller that has checked every tensor it was
        given and allocated the others itself (a quantizer's few microseconds of Python).
        `stream_window`: (address, bytes) this launch reads with L2's streaming property
        (`_launch_kernel_streaming`)."""
        self._launch(args, self._grid(
            {p.name: a for p, a in zip(self.spec.params, args) if p.kind != "ptr"}),
            stream_window)

    def _grid(self, scalars: dict) -> tuple:
        return _launch_grid(self.spec.key, [rule.evaluate(scalars) for rule in self.spec.grid])

    def bind(self, varying: tuple[str, ...], **constants) -> "Launcher":
        """A caller's own argument block for this kernel: `constants` (every parameter not
        named in `varying`) checked against the ABI and written once; see `Launcher`."""
        return Launcher(self, varying, constants)

    def _launch(self, args, grid: tuple[int, int, int], stream_window=None) -> None:
        if 0 in grid:
            return
        stream = _current_raw_stream(self.device_index)
        with self._lock:
            for slot, is_ptr, a in zip(self._slots, self._is_ptr, args):
                slot.value = a.data_ptr() if is_ptr else a
            if stream_window is None:
                _launch_kernel(self._handle, grid, self._tail, stream, self._argv_address)
            else:
                _launch_kernel_streaming(self._handle, grid, self._tail, stream,
                                         self._argv_address, stream_window)


class Launcher:
    """A kernel's argument block owned by one caller (a Buffer): the arguments fixed for the
    caller's life are checked and written once, and a launch writes only the `varying` ones, in
    that order, as ints (a pointer as its device address), packed into their slots by one
    `struct` call (about 20 ns a value), then the driver is called with the arguments before
    them looked up as one tuple. A dispatch kernel takes 64 arguments; a model's eager dispatch
    packs 27 of them a call (`cute_ep.ep.COMMON_DISPATCH_VARYING`), other calls 37."""

    def __init__(self, kernel: Kernel, varying: tuple[str, ...], constants: dict):
        spec = kernel.spec
        names = [p.name for p in spec.params]
        unknown = (set(varying) | set(constants)) - set(names)
        if unknown:
            raise TypeError(f"{spec.key} has no parameters {sorted(unknown)}")
        missing = set(names) - set(varying) - set(constants)
        if missing or set(varying) & set(constants):
            raise TypeError(f"{spec.key}: give every parameter once, either varying or constant "
                            f"(missing {sorted(missing)}, both {sorted(set(varying) & set(constants))})")
        self.kernel = kernel
        kinds = {p.name: p.kind for p in spec.params}
        # Varying values: 8 bytes each in one buffer (an i32 in the first 4), packed per launch.
        self._pack = struct.Struct("=" + "".join("i4x" if kinds[n] == "i32" else "q"
                                                 for n in varying)).pack_into
        self._packed = ctypes.create_string_buffer(8 * max(len(varying), 1))
        self._count = len(varying)
        self._slots = {n: _CTYPES[kinds[n]]() for n in names if n in constants}
        base = ctypes.addressof(self._packed)
        self._argv = (ctypes.c_void_p * len(names))(
            *[base + 8 * varying.index(n) if n in varying else ctypes.addressof(self._slots[n])
              for n in names])
        self._keep = []  # constant tensors, alive while their addresses are in the block
        for p in spec.params:
            if p.name not in constants:
                continue
            value = constants[p.name]
            if p.kind == "ptr":
                check_tensor(value, name=f"{spec.key}: {p.name}", dtype=p.dtype, align=p.align,
                             device_index=kernel.device_index)
                self._keep.append(value)
                value = value.data_ptr()
            else:
                _check_scalar(spec, p, value)
            self._slots[p.name].value = value
        # Each grid dimension as a constant or (position in `varying`, divisor, max).
        self._grid = []
        for rule in spec.grid:
            if rule.constant is not None:
                self._grid.append(rule.constant)
            elif rule.ceil_div[0] in constants:
                self._grid.append(rule.evaluate({rule.ceil_div[0]: constants[rule.ceil_div[0]]}))
            else:
                self._grid.append((varying.index(rule.ceil_div[0]), rule.ceil_div[1], rule.max))
        # A launch looks its grid up by the varying scalars the rules read (dispatch and combine:
        # the active channels, encode: the token count) instead of evaluating the rules.
        inputs = sorted({dim[0] for dim in self._grid if dim.__class__ is not int})
        self._grid_key = operator.itemgetter(*inputs) if inputs else _no_grid_key
        self._heads: dict = {}  # `_head` by the grid's scalars
        self._lock = threading.Lock()
        # torch's current stream when last launched on, and the driver argument made of it.
        self._stream: int | None = None
        self._stream_arg: ctypes.c_void_p | None = None
        self._tail = kernel._tail
        self._function = kernel._handle
        self._device_index = kernel.device_index
        self._argv_address = ctypes.c_void_p(ctypes.addressof(self._argv))

    def __call__(self, *values: int) -> None:
        try:
            head = self._heads.get(self._grid_key(values))
        except IndexError:  # too few values for the grid's scalars: `_head` says so
            head = None
        if head is None:
            head = self._head(values)
        if not head:  # a zero grid: nothing to launch
            return
        stream = _current_raw_stream(self._device_index)
        with self._lock:
            if stream != self._stream:
                self._stream, self._stream_arg = stream, ctypes.c_void_p(stream)
            try:
                self._pack(self._packed, 0, *values)
            except struct.error:
                if len(values) != self._count:
                    raise self._count_error(values) from None
                raise  # a value that its parameter's type cannot hold
            err = (_LAUNCH or _launcher())(*head, self._stream_arg, self._argv_address, None)
        if err:
            check(driver.CUresult(err))

    def _head(self, values) -> tuple:
        """The launch's leading driver arguments for these varying values (the function, the
        grid, the block and the shared memory bytes), remembered by the scalars the grid rules
        read; () for a zero grid."""
        if len(values) != self._count:
            raise self._count_error(values)
        if len(self._heads) >= _GRIDS_REMEMBERED:
            self._heads.clear()
        grid = _launch_grid(self.kernel.spec.key, self.grid_of(values))
        head = () if 0 in grid else (self._function, *grid, *self._tail)
        self._heads[self._grid_key(values)] = head
        return head

    def _count_error(self, values) -> TypeError:
        return TypeError(f"{self.kernel.spec.key}: a bound launch takes {self._count} varying "
                         f"arguments, got {len(values)}")

    def grid_of(self, values) -> list[int]:
        """The launch grid for these varying arguments (the spec's grid rules)."""
        grid = []
        for dim in self._grid:
            if dim.__class__ is int:
                grid.append(dim)
            else:
                at, divisor, most = dim
                n = -(-values[at] // divisor)
                grid.append(n if most is None else min(n, most))
        return grid


def _check_scalar(spec: KernelSpec, p, value) -> None:
    """Raise unless `value` is an int that fits scalar parameter `p` of `spec`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{spec.key}: {p.name} must be an int, got {type(value).__name__}")
    lo, hi = _INT_RANGES[p.kind]
    if not lo <= value <= hi:
        raise ValueError(f"{spec.key}: {p.name}={value} does not fit {p.kind}")
    # A scalar that repeats a compile-time constant (e.g. ranks) must agree with it: the kernel
    # was built for that value and sizes its accesses by it.
    if p.name in spec.config and value != spec.config[p.name]:
        raise ValueError(f"{spec.key}: {p.name}={value}, the kernel was built for "
                         f"{p.name}={spec.config[p.name]}")


def _no_grid_key(values) -> None:
    """The key of a grid that reads no varying scalar (it is the same for every launch)."""
    return None


def _public_raw_stream(device_index: int) -> int:
    """The handle of torch's current stream on the device through the public API (several
    microseconds of Python: the device index resolved, a Stream object made)."""
    return torch.cuda.current_stream(device_index).cuda_stream


# The handle of torch's current stream on a device: torch's raw accessor (one C call, a fraction
# of a microsecond) where the build has one, called directly rather than through a wrapper.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _public_raw_stream


def _torch_dtype(dtype: "str | torch.dtype | None"):
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_tensor(t, *, name: str, dtype: "str | torch.dtype | None", align: int = 1,
                 device_index: int | None = None):
    """Raise a clear error unless `t` is a contiguous CUDA tensor of `dtype` (None: any) aligned
    to `align` bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    if device_index is not None and t.get_device() != device_index:
        raise ValueError(f"{name} is on cuda:{t.get_device()}, the kernel runs on "
                         f"cuda:{device_index}")
    dtype = _torch_dtype(dtype)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride {tuple(t.stride())})")
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned, its address is "
                         f"{t.data_ptr() % align} bytes past a multiple of {align}")


class Runtime:
    """Per-process cache of loaded modules and kernels, keyed by device."""

    def __init__(self, manifest: Manifest | None = None):
        self._manifest = manifest
        self._contexts: dict[int, object] = {}
        self._modules: dict[tuple[int, str], object] = {}
        self._kernels: dict[tuple[int, str], Kernel] = {}
        self._selected: dict[tuple, Kernel] = {}
        self._lock = threading.Lock()

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = Manifest.load()
        return self._manifest

    def kernel(self, key: str, device: torch.device | int | None = None) -> Kernel:
        """The kernel for config `key` on `device` (default: the current CUDA device)."""
        index = _device_index(device)
        cached = self._kernels.get((index, key))
        if cached is not None:
            return cached
        with self._lock:
            if (index, key) not in self._kernels:
                self._kernels[(index, key)] = self._load(key, index)
        return self._kernels[(index, key)]

    def select(self, family: str, device=None, **fields) -> Kernel:
        """The kernel of `family` whose config has `fields` (see `Manifest.select`)."""
        index = _device_index(device)
        cache_key = (index, family, tuple(sorted(fields.items())))
        kernel = self._selected.get(cache_key)
        if kernel is None:
            arch = device_arch(torch.device("cuda", index))
            kernel = self.kernel(self.manifest.select(family, arch, **fields).key, index)
            self._selected[cache_key] = kernel
        return kernel

    def _load(self, key: str, index: int) -> Kernel:
        entry = self.manifest.lookup(key, device_arch(torch.device("cuda", index)))
        with torch.cuda.device(index):
            # torch owns the device's primary context; make sure it exists and is current.
            torch.cuda.current_stream(index)
            if index not in self._contexts:
                self._contexts[index] = check(driver.cuDevicePrimaryCtxRetain(
                    check(driver.cuDeviceGet(index))))
            check(driver.cuCtxSetCurrent(self._contexts[index]))
            module_key = (index, str(entry.cubin))
            module = self._modules.get(module_key)
            if module is None:
                module = check(driver.cuModuleLoadData(entry.cubin.read_bytes()))
                if entry.nvshmem:
                    from cute_ep.runtime.nvshmem import init_module

                    init_module(module, entry.key, entry.nvshmem)
                self._modules[module_key] = module
            function = check(driver.cuModuleGetFunction(module, entry.symbol.encode()))
            if entry.spec.smem_bytes > _DEFAULT_DYNAMIC_SMEM_LIMIT:
                check(driver.cuFuncSetAttribute(
                    function,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    entry.spec.smem_bytes))
        return Kernel(entry, function, index)


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The process-wide runtime over the default library ($CUTE_EP_LIBRARY or the package's)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime
