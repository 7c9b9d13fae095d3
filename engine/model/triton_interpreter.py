"""Mends for Triton's interpreter (`TRITON_INTERPRET=1`: kernels on CPU tensors, for tests).

Every module of Triton kernels calls `mend_interpreter()` on import when the interpreter is
on; compiled kernels are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch
import triton.language as tl


@functools.cache
def mend_interpreter() -> None:
    """Fixes three gaps of Triton 3.6's interpreter that compiled kernels do not have, and
    drops work whose result it throws away.

    It turns loop bounds into ints with `int()` of a one-element array, which NumPy >= 2.4
    refuses (triton-lang/triton#9171: every loop with runtime bounds fails), its `tl.dot`
    multiplies the bit patterns of bfloat16 operands as integers (triton-lang/triton#11584),
    and its float8 conversions are wrong at the edges: rounding to float8 ORs a mantissa that
    rounds up past its top bit into the exponent field instead of carrying (31.3 becomes 16,
    not 32), and widening turns a float8 NaN into 480. The replacements compute what a
    compiled kernel does; float8 conversions are torch's (rounding to nearest, ties to even).

    Its builders also check every 32-bit integer add, subtract and multiply for overflow
    (each operand widened to 64 bits, the result compared with both bounds), then hand the
    check to `device_assert`, which drops it: the interpreter's options never turn `debug`
    on. Those checks took about a third of a kernel's time under the interpreter. Here they
    follow `debug`, as compiled kernels' asserts do, so nothing that was checked is lost.

    Patches once, however often it is called.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot
    convert_float = interpreter._convert_float
    float8_dtypes = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    # Wider floats, as torch dtypes and the signed ints of their width (numpy views the bits).
    wide_dtypes = {tl.float32: (torch.float32, torch.int32),
                   tl.float16: (torch.float16, torch.int16),
                   tl.bfloat16: (torch.bfloat16, torch.int16)}

    def convert_float8(data: Any, input_dtype: Any, output_dtype: Any,
                       rounding_mode: Any) -> Any:
        if output_dtype in float8_dtypes and input_dtype.primitive_bitwidth > 8:
            widened = convert_float(data, input_dtype, tl.float32, None).view(np.float32)
            return torch.from_numpy(widened).to(float8_dtypes[output_dtype]).view(
                torch.uint8).numpy()
        if input_dtype in float8_dtypes and output_dtype in wide_dtypes:
            wide, bits = wide_dtypes[output_dtype]
            float8 = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(
                float8_dtypes[input_dtype])
            return float8.to(wide).view(bits).numpy().view(f"uint{bits.itemsize * 8}")
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    def patch_tensor_index(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def as_float32(handle: Any) -> Any:
        if handle.dtype != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot_bfloat16(builder: Any, a: Any, b: Any, *args: Any) -> Any:
        return create_dot(builder, as_float32(a), as_float32(b), *args)

    builder_init = interpreter.InterpreterBuilder.__init__

    def init_without_dropped_checks(builder: Any, *args: Any, **kwargs: Any) -> None:
        builder_init(builder, *args, **kwargs)
        skip_dropped_overflow_checks(builder)

    interpreter.InterpreterBuilder.__init__ = init_without_dropped_checks
    skip_dropped_overflow_checks(interpreter.interpreter_builder)
    interpreter._patch_lang_tensor = patch_tensor_index
    interpreter.InterpreterBuilder.create_dot = create_dot_bfloat16
    interpreter._convert_float = convert_float8


def skip_dropped_overflow_checks(builder: Any) -> None:
    """Sets an interpreter builder's `sanitize_overflow` to its `debug`: `device_assert`
    drops the overflow checks unless `debug` is on (`mend_interpreter`)."""
    builder.options = dataclasses.replace(builder.options,
                                          sanitize_overflow=builder.options.debug)
