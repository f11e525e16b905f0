"""The vector instructions the random-number kernels issue, one method per instruction.

The Philox rounds (:mod:`.philox`), the uniform transform (:mod:`.fill_rand`), Box–Muller
(:mod:`.fill_randn`), stochastic rounding (``quant/stochastic_cast.py``) and the round-to-nearest
casts (``quant/nearest_cast.py``) are plain Python functions over an ``ops`` object of this
interface: inside a ``T.SimdVF`` region the kernels pass :data:`VECTOR`, whose methods emit
``T.simd`` instructions on 64-lane registers (``uint32x64`` words, ``float32x64`` values,
``boolx256`` lane masks), each stored into a named register variable (a ``local.var`` buffer),
so the Ascend C has one statement per instruction and no value is computed twice. Not a
``Bind``: TileLang's ``LegalizeNegativeIndex`` pass expands bound values recursively,
exponential in how often a value is reused (Box–Muller's ~380 instructions took minutes);
register variables are opaque to it. ``tests/test_ascend_rng_lowering.py`` passes a numpy
object with the same methods (what each instruction is assumed to do) through the very same
functions (``tests/test_ascend_stochastic_cast_lowering.py`` and
``tests/test_ascend_nearest_cast_lowering.py`` extend it), which is how the word arithmetic and
the fp32 numerics are checked on a CPU.

What the methods assume of the hardware (unknown without an NPU): ``vmull`` on ``uint32``
returns the low then the high 32 bits of the unsigned 64-bit product; ``vshrs`` on ``uint32``
shifts in zeros and ``vshls`` drops the bits shifted past bit 31; ``vmins`` / ``vmaxs`` /
``vcmps`` on ``uint32`` compare unsigned; ``vcvt`` f32 → s32 with ``ROUND_Z`` truncates (exact
below 2^31); ``vintlv(a, b)`` returns ``(a0, b0, a1, b1, ..., a31, b31)`` then
``(a32, b32, ..., a63, b63)``; ``vmul`` / ``vadd`` / ``vsub`` (and ``vmuls`` / ``vadds`` with an fp32
scalar) round to nearest even and are not fused; ``vcvt`` s32 → f32 is exact below 2^24; ``vlds``
with ``UNPK_B16`` / ``UNPK4_B8`` puts halfword / byte ``i`` of the loaded ones in the low half / byte of
lane ``i`` (the lane's other bits are taken as unspecified); a narrowing ``vcvt`` u32 → u16 / u8 of a
value in range is exact; ``vln`` (``vln_1ulp_ftz_false``) is within 1 ulp; ``vsqrt`` / ``vdiv`` are
correctly rounded.
"""

import tilelang.ascend.language as T
from tvm import ir, tirx
from tvm.tirx.script.builder.ir import buffer_store, sblock_alloc_buffer

from tileplug.backend_ascend.rows import DIV_EXACT, SQRT_EXACT

U32, S32, F32 = "uint32", "int32", "float32"
TOWARD_ZERO = "ROUND_Z"
"""fp32 → int32 conversion by truncation."""
LN_1ULP = "vln_1ulp_ftz_false"
"""fp32 natural logarithm within 1 ulp, denormals kept (CANN's documented tier)."""


class VectorOps:
    """The ``T.simd`` instructions of the RNG kernels on 64-lane registers (call inside a
    ``T.SimdVF`` region, at trace time). Every result is stored into a register variable
    called ``name``."""

    @staticmethod
    def bind(value, name: str):
        """``value`` (a register expression) stored into a new register variable called
        ``name``; returns the variable's value."""
        dtype = str(value.dtype)
        data = tirx.Var(name, ir.PointerType(ir.PrimType(dtype), "local.var"))
        register = sblock_alloc_buffer([1], dtype, data=data, scope="local.var")
        buffer_store(register, value, [0])
        return register[0]

    # ------------------------------------------------------------------ uint32 words

    def ramp(self, first, name: str = "ramp"):
        """Words ``first + j`` in lane ``j`` (``first`` an int32 scalar, ``first + 63 < 2^31``)."""
        return self.bind(tirx.reinterpret("uint32x64", T.simd.vci(first, S32)), name)

    def splat(self, word: int, name: str = "splat"):
        """The word ``word`` (an int in ``[0, 2^32)``) in every lane."""
        return self.bind(T.simd.vdup(T.uint32(word), U32), name)

    def multiply_wide(self, a, b, name: str = "product"):
        """``a · b`` lane-wise as 64-bit unsigned products: ``(low words, high words)``."""
        low, high = T.simd.vmull(a, b)
        return self.bind(low, name + "_low"), self.bind(high, name + "_high")

    def xor(self, a, b, name: str = "mixed"):
        return self.bind(T.simd.vxor(a, b), name)

    def add_word(self, a, word: int, name: str = "sum"):
        """``a + word`` mod 2^32."""
        return self.bind(T.simd.vadds(a, T.uint32(word)), name)

    def sub(self, a, b, name: str = "difference"):
        """``a − b``: words mod 2^32, or fp32 values rounded."""
        return self.bind(T.simd.vsub(a, b), name)

    def shift_right(self, a, bits: int, name: str = "shifted"):
        """``a >> bits`` (logical: zeros shifted in)."""
        return self.bind(T.simd.vshrs(a, T.uint32(bits)), name)

    def and_word(self, a, word: int, name: str = "masked"):
        """``a & word``."""
        return self.bind(T.simd.vand(a, T.simd.vdup(T.uint32(word), U32)), name)

    def bit_set(self, a, bit: int, name: str = "has_bit"):
        """Lane mask: bit ``bit`` of the word is 1."""
        flag = T.simd.vand(a, T.simd.vdup(T.uint32(1 << bit), U32))
        return self.bind(T.simd.vcmps(flag, T.uint32(0), op="ne"), name)

    def to_float(self, a, name: str = "value"):
        """A word below 2^24 as the fp32 number it counts (exact)."""
        return self.bind(T.simd.vcvt(tirx.reinterpret("int32x64", a), F32), name)

    def shift_left(self, a, bits: int, name: str = "shifted"):
        """``a << bits`` mod 2^32."""
        return self.bind(T.simd.vshls(a, T.uint32(bits)), name)

    def add_words(self, a, b, name: str = "sum"):
        """``a + b`` lane-wise, mod 2^32."""
        return self.bind(T.simd.vadd(a, b), name)

    def or_words(self, a, b, name: str = "joined"):
        """``a | b`` lane-wise."""
        return self.bind(T.simd.vor(a, b), name)

    def or_word(self, a, word: int, name: str = "joined"):
        """``a | word``."""
        return self.bind(T.simd.vor(a, T.simd.vdup(T.uint32(word), U32)), name)

    def min_word(self, a, word: int, name: str = "smaller"):
        """``min(a, word)``, unsigned."""
        return self.bind(T.simd.vmins(a, T.uint32(word)), name)

    def max_word(self, a, word: int, name: str = "larger"):
        """``max(a, word)``, unsigned."""
        return self.bind(T.simd.vmaxs(a, T.uint32(word)), name)

    def above(self, a, word: int, name: str = "is_above"):
        """Lane mask: ``a > word``, unsigned."""
        return self.bind(T.simd.vcmps(a, T.uint32(word), op="gt"), name)

    def bits_as_float(self, a, name: str = "value"):
        """The fp32 numbers whose bit patterns the words are (a reinterpretation, no instruction)."""
        return self.bind(tirx.reinterpret("float32x64", a), name)

    def float_bits(self, a, name: str = "pattern"):
        """The bit patterns of fp32 values as words (a reinterpretation, no instruction)."""
        return self.bind(tirx.reinterpret("uint32x64", a), name)

    def truncate(self, a, name: str = "count"):
        """A non-negative fp32 value below 2^31 → its integer part, as a word (exact)."""
        return self.bind(tirx.reinterpret("uint32x64", T.simd.vcvt(a, S32, round=TOWARD_ZERO, sat=True)), name)

    # ------------------------------------------------------------------ fp32 values

    def constant(self, value: float, name: str = "constant"):
        """``value`` (an fp32 number) in every lane."""
        return self.bind(T.simd.vdup(T.float32(value), F32), name)

    def add(self, a, b, name: str = "total"):
        return self.bind(T.simd.vadd(a, b), name)

    def mul(self, a, b, name: str = "product"):
        return self.bind(T.simd.vmul(a, b), name)

    def scale(self, a, factor: float, name: str = "scaled"):
        """``a · factor`` (an fp32 constant), rounded."""
        return self.bind(T.simd.vmuls(a, T.float32(factor)), name)

    def plus(self, a, addend: float, name: str = "shifted"):
        """``a + addend`` (an fp32 constant), rounded."""
        return self.bind(T.simd.vadds(a, T.float32(addend)), name)

    def divide(self, a, b, name: str = "quotient"):
        """``a / b``, correctly rounded."""
        return self.bind(T.simd.vdiv(a, b, precision=DIV_EXACT), name)

    def ln(self, a, name: str = "log"):
        """``ln a`` within 1 ulp."""
        return self.bind(T.simd.vln(a, precision=LN_1ULP), name)

    def sqrt(self, a, name: str = "root"):
        """``sqrt a``, correctly rounded."""
        return self.bind(T.simd.vsqrt(a, precision=SQRT_EXACT), name)

    def positive(self, a, name: str = "is_positive"):
        """Lane mask: ``a > 0``."""
        return self.bind(T.simd.vcmps(a, T.float32(0.0), op="gt"), name)

    # ------------------------------------------------------------------ either

    def select(self, mask, a, b, name: str = "chosen"):
        """``a`` where ``mask`` holds, else ``b`` (words or values)."""
        return self.bind(T.simd.vsel(a, b, mask), name)

    def deinterleave(self, a, b, name: str = "deinterleaved"):
        """The even lanes of the 128 lanes ``a ++ b`` then the odd ones (``vdintlv``)."""
        pair = T.simd.vdintlv(a, b)
        return self.bind(pair[0], name + "_even"), self.bind(pair[1], name + "_odd")

    def gather(self, source, index, name: str = "gathered"):
        """Lane ``j`` of ``source`` at lane ``index[j]`` (``vselr``; ``index`` words below 64)."""
        return self.bind(T.simd.vselr(source, index), name)

    def and_words(self, a, b, name: str = "masked"):
        """``a & b`` lane-wise."""
        return self.bind(T.simd.vand(a, b), name)

    def interleave(self, a, b, name: str = "interleaved"):
        """``(a0, b0, a1, b1, ..., a31, b31)`` and ``(a32, b32, ..., a63, b63)``."""
        low, high = T.simd.vintlv(a, b)
        return self.bind(low, name + "_low"), self.bind(high, name + "_high")


VECTOR = VectorOps()
