"""The arithmetic of `kernels.division` and of `kernels.nvfp4.e2m1_word`, proved on the CPU.

The kernels replace a correctly rounded division per element by one reciprocal per block and
fmas, and the e2m1 threshold ladder by three fmas, a min and byte permutes. Their outputs must
stay byte for byte what they were, so the new arithmetic must give exactly RN(a / b) and exactly
the e2m1 codes. This file executes the kernels' own PTX text (the strings the kernels inline) in a
small interpreter of the straight-line instructions they use, over torch tensors on the CPU
(float32 products and sums round once, as on the GPU; an exact fma below), and compares:

- DIVIDE_ONCE_PTX against a / b for every significand of `a` and every significand an e4m3 scale
  can have: with no step under- or overflowing, every step scales by exact powers of two, so that
  is every case of the range the kernels use it in; beyond it, samples at every e4m3 scale.
- DIVIDE_TWICE_PTX against a / b where `b` is any fp32 (FP8's scale): samples, bf16 dividends at
  many divisors, and quotients within 2^-20 ulp of a rounding midpoint.
- E2M1_WORD_PTX against `cute_ep.reference.fp4` for every fp32 in [1/8, 8), the range where the
  thresholds lie (the encoder is monotone: each fma rounds monotonically and min keeps it, so
  code 0 below and 7 above follow from the ends, checked too), with signs and nibble order.
"""

import pytest
import torch

from cute_ep.reference import fp4

pytestmark = pytest.mark.build  # the PTX strings live in kernels/, which imports the DSL

F32 = torch.float32
F64 = torch.float64
U32 = 0xFFFFFFFF


def _next(f: torch.Tensor, up: bool) -> torch.Tensor:
    return torch.nextafter(f, torch.full_like(f, float("inf") if up else float("-inf")))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """RN_fp32(a * b + c) exactly, for fp32 tensors: the product is exact in fp64 (48 bits), the
    sum is kept as fp64 head + exact tail (two-sum), and the head is rounded to fp32 with the tail
    deciding the one case a plain conversion gets wrong (a head on a midpoint of fp32 values)."""
    prod = a.to(F64) * b.to(F64)
    c64 = c.to(F64)
    head = prod + c64
    virtual = head - prod
    tail = (prod - (head - virtual)) + (c64 - virtual)
    f = head.to(F32)
    above = f.to(F64) > head
    down = torch.where(above, _next(f, False), f)
    up = torch.where(above, f, _next(f, True))
    midpoint = head == (down.to(F64) + up.to(F64)) / 2
    return torch.where(midpoint & (tail > 0), up, torch.where(midpoint & (tail < 0), down, f))


def _as_f32(u: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the fp32 values of those bits."""
    return ((u ^ 0x80000000) - 0x80000000).to(torch.int32).view(F32)


def _as_u32(f: torch.Tensor) -> torch.Tensor:
    return f.contiguous().view(torch.int32).to(torch.int64) & U32


def _prmt(a, b, selector):
    out = torch.zeros_like(a)
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        src = a if (sel & 7) < 4 else b
        byte = (src >> (8 * (sel & 3))) & 0xFF
        if sel & 8:  # replicate the selected byte's top bit
            byte = torch.where((byte & 0x80) != 0, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = torch.zeros_like(a)
    for minterm in range(8):
        if lut >> minterm & 1:
            term = torch.full_like(a, U32)
            for bit, x in ((4, a), (2, b), (1, c)):
                term &= x if minterm & bit else ~x & U32
            out |= term
    return out


def _max_xorsign_abs_bf16x2(a, b):
    """Per 16-bit half: the bf16 of larger magnitude with the xor of the two signs as its sign,
    the canonical NaN 0x7FFF if either is NaN."""
    out = torch.zeros_like(a)
    for shift in (0, 16):
        x, y = (a >> shift) & 0xFFFF, (b >> shift) & 0xFFFF
        mx, my = x & 0x7FFF, y & 0x7FFF
        nan = (mx > 0x7F80) | (my > 0x7F80)
        half = torch.maximum(mx, my) | ((x ^ y) & 0x8000)  # magnitudes order as integers
        out |= torch.where(nan, 0x7FFF, half) << shift
    return out


def run_ptx(text: str, *inputs: torch.Tensor) -> torch.Tensor:
    """Execute an inline-asm snippet of straight-line PTX (`$1...` the fp32 inputs, `$0` the
    result) on tensors. Knows the instructions the kernels' snippets use; anything else fails."""
    regs = {f"${i + 1}": _as_u32(x.to(F32)) for i, x in enumerate(inputs)}
    shape = inputs[0].shape

    def value(operand):
        if operand in regs:
            return regs[operand]
        if operand.startswith("0f"):
            return torch.full(shape, int(operand[2:], 16), dtype=torch.int64)
        return torch.full(shape, int(operand, 0) & U32, dtype=torch.int64)

    floats = {
        "abs.f32": lambda x: x.abs(), "neg.f32": lambda x: -x,
        "mul.rn.f32": lambda x, y: x * y, "add.rn.f32": lambda x, y: x + y,
        "fma.rn.f32": fma32, "min.f32": torch.fmin, "max.NaN.f32": torch.maximum,
    }
    ints = {
        "mov.b32": lambda x: x, "and.b32": lambda x, y: x & y, "or.b32": lambda x, y: x | y,
        "shl.b32": lambda x, n: (x << n) & U32, "shr.u32": lambda x, n: x >> n,
        "prmt.b32": lambda x, y, s: _prmt(x, y, int(s[0])), "lop3.b32": _lop3,
        "add.u32": lambda x, y: (x + y) & U32,
        "max.NaN.xorsign.abs.bf16x2": _max_xorsign_abs_bf16x2,
    }
    for statement in text.strip().strip("{}").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        dst, *srcs = [a.strip() for a in rest.split(",")]
        if op in floats:
            regs[dst] = _as_u32(floats[op](*[_as_f32(value(s)) for s in srcs]))
        elif op == "prmt.b32":
            regs[dst] = _prmt(value(srcs[0]), value(srcs[1]), int(srcs[2], 0))
        elif op == "lop3.b32":
            regs[dst] = _lop3(value(srcs[0]), value(srcs[1]), value(srcs[2]), int(srcs[3], 0))
        elif op in ("shl.b32", "shr.u32"):
            regs[dst] = ints[op](value(srcs[0]), int(srcs[1], 0))
        else:
            regs[dst] = ints[op](*[value(s) for s in srcs])
    return regs["$0"]


def divide_once(a, b, r):
    from kernels.division import DIVIDE_ONCE_PTX

    return _as_f32(run_ptx(DIVIDE_ONCE_PTX, a, b, r))


def divide_twice(a, b, r):
    from kernels.division import DIVIDE_TWICE_PTX

    return _as_f32(run_ptx(DIVIDE_TWICE_PTX, a, b, r))


def reciprocal_low(b, r_hi):
    from kernels.division import RECIPROCAL_LOW_PTX

    return _as_f32(run_ptx(RECIPROCAL_LOW_PTX, b, r_hi))


def divide_split(a, b):
    """The kernels' two-operation quotient a / b, from b's split reciprocal computed as they
    compute it."""
    from kernels.division import DIVIDE_SPLIT_PTX

    r_hi = torch.ones_like(b) / b
    return _as_f32(run_ptx(DIVIDE_SPLIT_PTX, a, r_hi, reciprocal_low(b, r_hi)))


def e2m1_words(values: torch.Tensor, signs: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """[n, 8] fp32 values and sign sources -> the kernel's [n] packed words (uint32 in int64),
    by the saturating encoder or the one for values below 7."""
    from kernels.nvfp4 import E2M1_WORD_BELOW_7_PTX, E2M1_WORD_PTX

    text = E2M1_WORD_PTX if saturate else E2M1_WORD_BELOW_7_PTX
    return run_ptx(text, *values.unbind(1), *signs.unbind(1))


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[n] packed words -> their [n, 8] codes, element i from nibble i."""
    return torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=1).to(torch.uint8)


def e2m1_magnitude(v: torch.Tensor) -> torch.Tensor:
    """The codes (0..15, the sign bit included) the kernel's encoder gives each of `v`."""
    flat = v.reshape(-1)
    pad = -flat.numel() % 8
    flat = torch.cat([flat, torch.zeros(pad)]).reshape(-1, 8)
    words = e2m1_words(flat, flat)
    return _nibbles(words).reshape(-1)[: v.numel()].reshape(v.shape)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(F32)


def _significands(exponent: int) -> torch.Tensor:
    """Every fp32 in [2^exponent, 2^(exponent + 1))."""
    return _f32(((exponent + 127) << 23) + torch.arange(1 << 23, dtype=torch.int64))


E4M3_SIGNIFICANDS = [1.0 + i / 8 for i in range(8)]


def _e4m3_positive() -> torch.Tensor:
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(torch.float8_e4m3fn).to(F32)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_fma_model_rounds_once():
    def fma(a, b, c):
        return fma32(*(torch.tensor([v], dtype=F64).to(F32) for v in (a, b, c))).item()

    x = 2.0 ** -23
    # (1 + x)(1 - x) = 1 - x^2: kept by an fma, lost by a product rounded first.
    assert fma(1 + x, 1 - x, -1.0) == -(2.0 ** -46)
    assert fma(1 + x, 1 - x, 0.0) == 1.0
    # Sums whose fp64 head lands exactly on a midpoint of fp32 values, the tail deciding against
    # ties-to-even: 1 + 2^-24 + 2^-70 rounds up to 1 + 2^-23 (even would be 1) ...
    assert fma(-(2.0 ** -24) * (1 + x), 1 - x, 1 + x) == 1 + x
    # ... and 1 + 1.5 * 2^-23 - 2^-70 rounds down to 1 + 2^-23 (even would be 1 + 2^-22).
    assert fma(2.0 ** -24 * (1 + x), 1 - x, 1 + x) == 1 + x
    assert fma(2.0 ** -24, 1.0, 1.0) == 1.0  # an exact tie: to even


@pytest.mark.parametrize("significand", E4M3_SIGNIFICANDS)
def test_divide_once_is_the_correctly_rounded_quotient_for_every_dividend(significand):
    a = _significands(0)
    b = torch.full_like(a, significand)
    r = torch.ones_like(a) / b
    assert _same_bits(divide_once(a, b, r), a / b)


def _normal_dividends(seed: int, n: int = 4096) -> torch.Tensor:
    """n random fp32 dividends of either sign with exponents from -79 (below it the quotient
    rounds to code 0 whatever the steps do) up to the kernels' FAST_LIMIT 2^100."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-79, 100, (n,), generator=gen)
    significands = torch.randint(0, 1 << 23, (n,), generator=gen)
    a = _f32(((exponents + 127) << 23) + significands)
    return torch.where(torch.rand(n, generator=gen) < 0.5, -a, a)


def test_divide_once_at_every_e4m3_scale_and_dividend_exponent():
    scales = _e4m3_positive()
    a, b = torch.broadcast_tensors(_normal_dividends(1)[:, None], scales[None, :])
    r = torch.ones_like(b) / b
    q = divide_once(a, b, r)
    want = a / b
    assert torch.equal(q.abs(), want.abs())


def test_divide_once_below_the_normal_range_stays_code_zero():
    # |a| < 2^-79: steps may go subnormal, but the quotient stays far below e2m1's 0.25.
    tiny = _f32(torch.cat([torch.arange(1, 1 << 13), torch.randint(1 << 13, 48 << 23, (1 << 13,),
                                                                     generator=torch.Generator()
                                                                     .manual_seed(2))]))
    scales = _e4m3_positive()
    a, b = torch.broadcast_tensors(tiny[:, None], scales[None, :])
    q = divide_once(a, b, torch.ones_like(b) / b)
    assert (e2m1_magnitude(q) == 0).all()
    assert (q.abs() < 2.0 ** -60).all()


@pytest.mark.parametrize("significand", E4M3_SIGNIFICANDS)
def test_divide_split_is_the_correctly_rounded_quotient_for_every_dividend(significand):
    """Every fp32 significand against each e4m3 significand: exact model of the product and
    the fma (scaling by powers of two changes no step while nothing leaves the normal range)."""
    a = _significands(0)
    b = torch.full_like(a, significand)
    assert _same_bits(divide_split(a, b), a / b)
    assert _same_bits(divide_split(-a, b), -a / b)


def test_divide_split_at_every_e4m3_scale_and_dividend_exponent():
    scales = _e4m3_positive()  # subnormal scales (K 1..7 times 2^-9) included
    a, b = torch.broadcast_tensors(_normal_dividends(4)[:, None], scales[None, :])
    assert torch.equal(divide_split(a, b).abs(), (a / b).abs())
    # Below 2^-79 the steps may go subnormal; the quotient stays far below e2m1's 0.25.
    tiny = _f32(torch.arange(1, 1 << 13) * 4099 % (48 << 23))
    a, b = torch.broadcast_tensors(tiny[:, None], scales[None, :])
    q = divide_split(a, b)
    assert (e2m1_magnitude(q) == 0).all() and (q.abs() < 2.0 ** -60).all()


def test_divide_split_of_six_is_the_scale_quotient():
    """The NVFP4 scale's gs * amax / 6 by the split reciprocal of 6 (3 * 2: an e4m3 value), whose
    two halves are constants of the kernels."""
    from kernels.nvfp4 import SIXTH, SIXTH_LO

    six = torch.tensor([6.0])
    assert torch.tensor([SIXTH], dtype=F32).item() == (torch.ones(1) / six).item()
    assert reciprocal_low(six, torch.ones(1) / six).item() == SIXTH_LO
    a = _significands(3)
    assert _same_bits(divide_split(a, torch.full_like(a, 6.0)), a / 6.0)


def test_divide_twice_is_the_correctly_rounded_quotient():
    gen = torch.Generator().manual_seed(3)
    n = 1 << 21
    b = _f32((127 << 23) + torch.randint(0, 1 << 23, (n,), generator=gen))
    a = _f32(((127 + torch.randint(0, 2, (n,), generator=gen)) << 23)
             + torch.randint(0, 1 << 23, (n,), generator=gen))
    r = torch.ones_like(b) / b
    assert _same_bits(divide_twice(a, b, r), a / b)
    # bf16 dividends (dispatch's FP8 encoder) against 8192 divisors: every significand.
    bf16 = _f32((127 << 23) + (torch.arange(256) << 16))
    bs = _f32((127 << 23) + torch.randint(0, 1 << 23, (8192,), generator=gen))
    a, b = torch.broadcast_tensors(bf16[:, None], bs[None, :])
    r = torch.ones_like(b) / b
    assert _same_bits(divide_twice(a, b, r), a / b)


def test_divide_twice_near_rounding_midpoints():
    """Dividends whose quotient lies within 2^-20 ulp of a midpoint of fp32 values, the cases a
    division gets wrong first: a = RN(m * b) for a midpoint m."""
    gen = torch.Generator().manual_seed(4)
    n = 1 << 21
    b = _f32((127 << 23) + torch.randint(0, 1 << 23, (n,), generator=gen)).to(F64)
    m = (_f32((127 << 23) + torch.randint(0, 1 << 23, (n,), generator=gen)).to(F64)
         + 2.0 ** -24)
    a = (m * b).to(F32)
    b = b.to(F32)
    r = torch.ones_like(b) / b
    assert _same_bits(divide_twice(a, b, r), a / b)
    assert _same_bits(divide_once(a, b, r), a / b)


def test_divide_twice_keeps_fp8_quotients_of_small_and_large_dividends():
    gen = torch.Generator().manual_seed(5)
    n = 1 << 18
    b = _f32(((torch.randint(-22, 90, (n,), generator=gen) + 127) << 23)
             + torch.randint(0, 1 << 23, (n,), generator=gen))
    a = _f32(((torch.randint(-60, 100, (n,), generator=gen) + 127) << 23)
             + torch.randint(0, 1 << 23, (n,), generator=gen))
    keep = (a / b).abs() < 2.0 ** 60
    a, b = a[keep], b[keep]
    r = torch.ones_like(b) / b
    assert torch.equal(divide_twice(a, b, r).abs(), (a / b).abs())


def test_with_sign_of_copies_only_the_sign_bit():
    from kernels.division import WITH_SIGN_OF_PTX

    gen = torch.Generator().manual_seed(6)
    bits = torch.randint(-(1 << 31), 1 << 31, (2, 1 << 16), generator=gen, dtype=torch.int64)
    m, s = _f32(bits[0]), _f32(bits[1])
    m = torch.cat([m, torch.tensor([0.0, 0.0, float("inf"), 1.0])])
    s = torch.cat([s, torch.tensor([-0.0, 1.0, -2.0, -0.0])])
    got = _as_f32(run_ptx(WITH_SIGN_OF_PTX, m, s))
    want = (_as_u32(m) & 0x7FFFFFFF) | (_as_u32(s) & 0x80000000)
    assert torch.equal(_as_u32(got), want)


@pytest.mark.parametrize("exponent", [-3, -2, -1, 0, 1, 2])
def test_e2m1_magnitude_for_every_fp32_between_an_eighth_and_eight(exponent):
    v = _significands(exponent)
    want = fp4.e2m1_encode(v)
    assert torch.equal(e2m1_magnitude(v), want)


def test_e2m1_word_ends_signs_and_nibble_order():
    small = torch.tensor([0.0, 2.0 ** -149, 1e-30, 0.125 - 2 ** -27, 0.2499999], dtype=F32)
    assert e2m1_magnitude(small).tolist() == [0] * 5
    large = torch.tensor([8.0, 1e10, 3.4e38, float("inf")], dtype=F32)
    assert e2m1_magnitude(large).tolist() == [7] * 4
    v = -_significands(0)
    assert torch.equal(e2m1_magnitude(v), fp4.e2m1_encode(v))  # 8 | code
    assert e2m1_magnitude(torch.tensor([-0.0, 0.0])).tolist() == [8, 0]
    # Signs come from the second operand; element i lands in nibble i.
    values = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]])
    signs = torch.tensor([[1.0, -1.0, 1.0, -1.0, -0.0, 2.0, -3.0, 0.0]])
    assert e2m1_words(values, signs).item() == 0x7E5CB290


def _bf16_pairs(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 4] random words of two bf16 each (any bits: signs, zeros, subnormals, infinities and
    NaNs included), as the fp32 tensors run_ptx takes."""
    return _as_f32(torch.randint(0, 1 << 32, (n, 4), generator=gen, dtype=torch.int64))


def _bf16_halves(words: torch.Tensor) -> torch.Tensor:
    """[n, 4] pair words -> [n, 8] fp32 of their bf16 values, element 2k the low half of k."""
    u = _as_u32(words)
    low, high = (u & 0xFFFF) << 16, u & 0xFFFF0000
    return _as_f32(torch.stack([low, high], dim=2).reshape(u.shape[0], 8))


def test_bf16x2_amax_is_the_largest_magnitude_and_keeps_nans():
    from kernels.nvfp4 import BF16X2_AMAX_PTX

    gen = torch.Generator().manual_seed(1)
    words = torch.cat([_bf16_pairs(20000, gen), _bf16_pairs(20000, gen)], dim=1)  # 16 values
    # Half the rows without NaN, so most maxima are numbers.
    u = _as_u32(words)
    exponent_all_ones = ((u >> 7) & 0xFF) == 0xFF
    u = torch.where(exponent_all_ones & (torch.arange(u.shape[0]) % 2 == 0).unsqueeze(1),
                    u & ~0x00800080 & U32, u)
    words = _as_f32(u)
    got = _as_f32(run_ptx(BF16X2_AMAX_PTX, *words.unbind(1)))
    values = torch.cat([_bf16_halves(words[:, :4]), _bf16_halves(words[:, 4:])], dim=1)
    want = values.abs().amax(dim=1)  # NaN if any is
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]) and ok.sum() > 9000
    zeros = torch.zeros(1, 8)
    zeros[0, 3] = -0.0
    assert _as_f32(run_ptx(BF16X2_AMAX_PTX, *zeros.unbind(1))).item() == 0.0


def _pairs_word_codes(values: torch.Tensor, words: torch.Tensor, saturate: bool) -> torch.Tensor:
    from kernels.nvfp4 import E2M1_PAIRS_WORD_BELOW_7_PTX, E2M1_PAIRS_WORD_PTX

    text = E2M1_PAIRS_WORD_PTX if saturate else E2M1_PAIRS_WORD_BELOW_7_PTX
    return _nibbles(run_ptx(text, *values.unbind(1), *words.unbind(1)))


@pytest.mark.parametrize("saturate", [True, False])
def test_e2m1_pairs_word_takes_each_sign_from_its_bf16_and_packs_nibbles_in_order(saturate):
    gen = torch.Generator().manual_seed(2)
    words = _bf16_pairs(50000, gen)
    signs = _bf16_halves(words)
    magnitudes = torch.rand(50000, 8, generator=gen) * 6.9
    want = fp4.e2m1_encode(magnitudes) | (torch.signbit(signs).to(torch.uint8) << 3)
    assert torch.equal(_pairs_word_codes(magnitudes, words, saturate), want)
    # The value's own sign is ignored: only the bf16's counts.
    assert torch.equal(_pairs_word_codes(-magnitudes, words, saturate), want)


@pytest.mark.parametrize("exponent", [-3, -2, -1, 0, 1, 2])
def test_e2m1_pairs_word_below_7_for_every_fp32_from_an_eighth(exponent):
    """Without saturation, every fp32 magnitude below 7 still encodes as the reference."""
    v = _significands(exponent)
    v = v[v < 7.0]
    pad = -v.numel() % 8
    values = torch.cat([v, torch.zeros(pad)]).reshape(-1, 8)
    words = torch.zeros(values.shape[0], 4)
    codes = _pairs_word_codes(values, words, saturate=False).reshape(-1)[: v.numel()]
    assert torch.equal(codes, fp4.e2m1_encode(v))


def test_bounded_scales_keep_every_quotient_below_7():
    """For s = gs * amax / 6 in [BOUNDED_LOW, BOUNDED_HIGH), sf = e4m3(s) is within 2^-4 of s,
    so the block's largest quotient RN(RN(gs * amax) / sf) stays below 7: checked at the far end
    of every e4m3 code's rounding interval (s up to the midpoint to the next code, gs * amax
    up to 6 s rounded up)."""
    from kernels.nvfp4 import BOUNDED_HIGH, BOUNDED_LOW

    codes = torch.arange(0x08, 0x7F, dtype=torch.uint8)  # the normal e4m3 codes up to 448
    sf = codes.view(torch.float8_e4m3fn).to(F64)
    following = torch.cat([sf[1:], torch.tensor([BOUNDED_HIGH], dtype=F64)])
    s_far = (sf + following) / 2  # s rounds to sf below this (or exactly on it, to even)
    assert sf[0] == BOUNDED_LOW and BOUNDED_HIGH == 464.0  # 448's interval ends at 464
    m_far = 6 * s_far * (1 + 2.0 ** -22)  # RN(gs * amax) with RN(m / 6) <= s_far, generously
    assert (m_far / sf).max() < 6.41
    assert torch.equal(torch.tensor(1.0, dtype=F32) / 6, torch.tensor(_sixth(), dtype=F32))


def _sixth() -> float:
    from kernels.nvfp4 import SIXTH

    return SIXTH


@pytest.mark.parametrize("exponent", [-3, -2, -1, 0, 1, 2])
def test_e2m1_word_below_7_for_every_fp32_from_an_eighth(exponent):
    """The unsaturated e2m1_word (SwiGLU-OAI's MXFP4 codes) encodes every fp32 magnitude below 7
    as the reference, each with its sign source's sign."""
    v = _significands(exponent)
    v = v[v < 7.0]
    pad = -v.numel() % 8
    values = torch.cat([v, torch.zeros(pad)]).reshape(-1, 8)
    signs = values.clone()
    signs[1::2] = -signs[1::2]  # every other row negative
    want = fp4.e2m1_encode(values) | (torch.signbit(signs).to(torch.uint8) << 3)
    assert torch.equal(_nibbles(e2m1_words(values, signs, saturate=False)), want)


def _mxfp4_largest_quotient(amax: torch.Tensor) -> torch.Tensor:
    """amax * 2^-e, exactly (fp64), for 2^e the MXFP4 scale of a block whose amax it is: the
    reference's e8m0 rounding up of RN(amax / 6), decoded as the kernel does (2^(127 - code))."""
    codes = fp4.e8m0_round_up(amax / torch.full_like(amax, 6.0)).to(torch.float64)
    return amax.to(F64) * torch.exp2(127 - codes)


def test_mxfp4_quotients_stay_below_7_for_every_finite_amax():
    """Why SwiGLU-OAI's MXFP4 codes may skip their saturation when the amax is finite: the
    largest quotient of a block, amax * 2^-e, never reaches 7 (it stays at or below
    6 (1 + 2^-23)). Every significand of one binade (scaling amax by 2 scales q by 2 and moves
    the code by one while both are normal), then every binade's extremes, the subnormals and
    the largest finite fp32; an infinite amax does need the saturation."""
    worst = _mxfp4_largest_quotient(_significands(0)).max().item()
    assert 6.0 <= worst <= 6.0 * (1 + 2.0 ** -23)
    ends = torch.cat([_f32(torch.tensor([(e << 23) + d for e in range(1, 255)
                                         for d in (0, 1, (1 << 23) - 1)], dtype=torch.int64)),
                      _f32(torch.arange(1, 1 << 16, dtype=torch.int64) * 97)])  # subnormals
    assert _mxfp4_largest_quotient(ends).max().item() <= 6.0 * (1 + 2.0 ** -23)
    inf = torch.tensor([float("inf")])
    assert _mxfp4_largest_quotient(inf).item() == float("inf")
