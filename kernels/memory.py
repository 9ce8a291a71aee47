"""Scalar global-memory accesses by address, shared by the transport kernels (their buffers are
addressed from a base plus a layout's offset, often in another GPU's memory)."""

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from layouts.buffers import ERROR_FIELDS
from layouts.channels import trace_layout
from layouts.scales import ATOM_BYTES, ATOM_ROWS, ATOM_SCALE_COLUMNS

ATOM_ROW_BITS = ATOM_ROWS.bit_length() - 1
ATOM_COLUMN_BITS = ATOM_SCALE_COLUMNS.bit_length() - 1
assert 1 << ATOM_ROW_BITS == ATOM_ROWS and 1 << ATOM_COLUMN_BITS == ATOM_SCALE_COLUMNS
assert ATOM_ROWS == 128 and ATOM_SCALE_COLUMNS == 4  # the 32 x 4 x 4 interleave below


def gmem_ptr(dtype, addr, align):
    """A global-memory pointer of `dtype` at the integer address `addr`."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@dsl_user_op
def take_ticket(addr, *, loc=None, ip=None) -> Int32:
    """The int32 at global address `addr` before adding 1 to it (a relaxed gpu-scope atomic),
    as the PTX `atom` itself: the compiler's warp aggregation of a uniform atomic (one lane's
    atomic, then a shuffle of its result to the others) would wait for the result at once,
    where a caller that uses it a step later lets the round trip pass under that step."""
    return Int32(llvm.inline_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
                                 "atom.relaxed.gpu.global.inc.u32 $0, [$1], 2147483647;", "=r,l",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    """Suspend the thread for about `ns` nanoseconds (PTX `nanosleep`): a poll loop that yields
    its issue slots to the SM's other warps."""
    llvm.inline_asm(None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def load_i32(addr):
    return cute.make_tensor(gmem_ptr(Int32, addr, 4), cute.make_layout(1))[0]


@cute.jit
def load_f32(addr):
    return cute.make_tensor(gmem_ptr(Float32, addr, 4), cute.make_layout(1))[0]


@cute.jit
def store_i32(addr, value):
    cute.make_tensor(gmem_ptr(Int32, addr, 4), cute.make_layout(1))[0] = Int32(value)


@cute.jit
def store_f32(addr, value):
    cute.make_tensor(gmem_ptr(Float32, addr, 4), cute.make_layout(1))[0] = Float32(value)


@cute.jit
def store_u8(addr, value):
    """The low byte of `value` at `addr`."""
    cute.make_tensor(gmem_ptr(Uint8, addr, 1), cute.make_layout(1))[0] = Uint8(value)


def error_field(error: cute.Pointer, name: str):
    """A pointer to word `name` (ERROR_FIELDS) of the device error record at `error`."""
    return gmem_ptr(Int32, error.toint() + 4 * ERROR_FIELDS.index(name), 4)


def trace_word(trace: cute.Pointer, channel, fields: tuple, field: str):
    """A pointer to word `field` of `fields` (a dispatch's TRACE_FIELDS, a combine's
    COMBINE_TRACE_FIELDS) in channel `channel`'s row of the trace at `trace`."""
    return gmem_ptr(Int64, trace.toint() + Int64(trace_layout(channel + 1, fields)(
        (fields.index(field), channel))) * 8, 8)


@cute.jit
def scale_offset(row, col, rk):
    """Byte offset of scale column `col` of scale row `row` (both >= 0) in the 128x4 layout of
    block-scaled MMA (`layouts.scales`), `rk` 4-column atoms across a 128-row block."""
    return ((Int64(row >> ATOM_ROW_BITS) * Int64(rk) + Int64(col >> ATOM_COLUMN_BITS))
            * ATOM_BYTES + Int64(((row & 31) << 4) | (((row >> 5) & 3) << 2)
                                 | (col & (ATOM_SCALE_COLUMNS - 1))))
