"""The kernels compile, through ptxas, for an sm_90 (Hopper) GPU.

The interpreter checks what the kernels compute; only the real compiler checks that they are
valid Triton for a GPU (loop-carried types, constexpr branches, layouts, shared memory). No
GPU is needed to compile, so this runs everywhere, in a subprocess without the interpreter.
"""

import textwrap

from support.triton_compile import compiled_output

COMPILE_ALL = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sluice.kernels import attention, cache

    HOPPER = GPUTarget("cuda", 90, 32)
    ATTENTION_POINTERS = dict(
        Out="*DT", PartialOut="*fp32", PartialMax="*fp32", PartialSum="*fp32", Query="*DT",
        KeyCache="*DT", ValueCache="*DT", BlockTables="*i32", QueryStartLoc="*i32",
        SeqLens="*i32")

    def build(kernel, pointers, constexprs, dtype, floats=()):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = pointers[name].replace("DT", dtype)
            else:
                signature[name] = "fp32" if name in floats else "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)
        assert "ptx" in compiled.asm and "cubin" in compiled.asm
        print(kernel.__name__, dtype, constexprs.get("NUM_SPLITS"), "compiled")

    decode = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, QUERIES_PER_KV=4, BLOCK_M=16,
                  BLOCK_Q=4, TILE_N=32, NUM_SPLITS=8)
    mixed = dict(HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=32, QUERIES_PER_KV=3, BLOCK_M=64,
                 BLOCK_Q=21, TILE_N=32, NUM_SPLITS=1)
    floats = ("scale_log2", "softcap_scale", "softcap_log2")
    plain = dict(USE_WINDOW=False, USE_SOFTCAP=False)
    for dtype, shapes in (("bf16", (decode, mixed)), ("fp16", (decode,)), ("fp32", (mixed,))):
        for shape in shapes:
            build(attention._paged_attention_kernel, ATTENTION_POINTERS,
                  dict(shape, DOT_IN_FP32=dtype == "fp32", **plain), dtype, floats=floats)
    # a sliding window and a soft cap, together and each alone
    for dtype, shape, switches in (("bf16", decode, (True, True)), ("bf16", mixed, (True, False)),
                                   ("fp32", mixed, (False, True))):
        build(attention._paged_attention_kernel, ATTENTION_POINTERS,
              dict(shape, DOT_IN_FP32=dtype == "fp32", USE_WINDOW=switches[0],
                   USE_SOFTCAP=switches[1]), dtype, floats=floats)
    build(attention._merge_splits_kernel, ATTENTION_POINTERS,
          dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8), "bf16")
    build(cache._reshape_and_cache_kernel,
          dict(Key="*DT", Value="*DT", KeyCache="*DT", ValueCache="*DT", SlotMapping="*i64"),
          dict(NUM_KV_HEADS=3, HEAD_DIM=64, HEADS_PAD=4, HEAD_DIM_PAD=64, BLOCK_SIZE=16), "bf16")
""")


def test_kernels_compile_for_sm90():
    assert compiled_output(COMPILE_ALL).count("compiled") == 9
