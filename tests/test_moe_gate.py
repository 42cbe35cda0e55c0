"""The MoE gate kernel (`pallas_kernels.moe_gate`: a decode layer's residual add, post-attention RMSNorm and router
logits in one launch, Pallas Triton backend) against its jnp reference: interpret mode on CPU, cross-lowered for
sm_90, in a scanned model's decode step, and compiled on a Hopper GPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.moe_gate import MAX_ROWS, moe_gate, moe_gate_problems, moe_gate_reference
from pallas_kernels.stacked_matmul import Partials
from tests.tiers import full, gpu_full

EPS = 1e-6


def _inputs(T, D, E, S, *, L=3, weight_dtype=jnp.float32, seed=0):
    """x [T, D] bf16; the attention rows (S = 0: bf16 [T, D]) or `Partials` of S splits (fp32 [S, T, D]); a stack
    of L norm weights and routers, each layer's different."""
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (T, D), jnp.bfloat16)
    if S:
        attn = Partials(jax.random.normal(k[1], (S, T, D), jnp.float32) / S, (T, D), jnp.dtype(jnp.bfloat16))
    else:
        attn = jax.random.normal(k[1], (T, D), jnp.bfloat16)
    w = (1.0 + 0.2 * jax.random.normal(k[2], (L, D), jnp.float32)).astype(weight_dtype)
    r = jax.random.normal(k[3], (L, D, E), jnp.float32) / np.sqrt(D)
    return x, attn, w, r


def _assert_close(got, want):
    h, y, logits = got
    h0, y0, l0 = want
    assert (h.dtype, y.dtype, logits.dtype) == (h0.dtype, y0.dtype, jnp.float32)
    assert h.shape == h0.shape and y.shape == y0.shape and logits.shape == l0.shape
    # h and y are the same bf16 arithmetic (a partial sum in another order may move a value by one bf16 step)
    chex.assert_trees_all_close(
        (h.astype(jnp.float32), y.astype(jnp.float32)), (h0.astype(jnp.float32), y0.astype(jnp.float32)), rtol=1e-2
    )
    chex.assert_trees_all_close(logits, l0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "T, D, E, S, weight_dtype",
    full(
        [
            (1, 256, 64, 8, jnp.float32),  # a V2-Lite decode step's shape, narrower: wo's 8 partials
            (3, 128, 8, 0, jnp.bfloat16),  # the built-in model's 8 experts, summed rows, bf16 norm weight
            (MAX_ROWS, 128, 32, 4, jnp.float32),
            (2, 512, 16, 2, jnp.bfloat16),
        ],
        [(1, 256, 64, 8, jnp.float32), (3, 128, 8, 0, jnp.bfloat16)],
        "the quick tier runs the one-row partials case and the summed-rows case",
    ),
)
def test_interpret_equals_reference(T, D, E, S, weight_dtype):
    """The kernel in the interpreter against `moe_gate_reference` at layer 2 of a stack of 3: h, y and the logits.
    Catches a split of the partials not summed, the norm's eps or weight dropped, the weight or router read at
    another layer (each layer's differ), a column block written at another block's place."""
    x, attn, w, r = _inputs(T, D, E, S, weight_dtype=weight_dtype)
    got = moe_gate(x, attn, w, r, jnp.int32(2), eps=EPS, impl="interpret")
    _assert_close(got, moe_gate_reference(x, attn, w, r, 2, eps=EPS))
    other = moe_gate_reference(x, attn, w, r, 1, eps=EPS)
    assert not np.allclose(np.asarray(got[2]), np.asarray(other[2]), atol=1e-3)


@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
def test_one_layer_and_y_in_another_dtype(weight_dtype):
    """Unstacked weights ([D], [D, E]) take no layer, and y comes in the `dtype` asked (fp32 here, the MoE's own
    dtype), its values `rms_norm`'s: the bf16 normalised row times the weight in their promoted dtype (a bf16 weight's
    product rounded to bf16 before the cast to fp32; catches the product left in fp32)."""
    x, attn, w, r = _inputs(2, 128, 16, 2, weight_dtype=weight_dtype)
    got = moe_gate(x, attn, w[0], r[0], eps=EPS, dtype=jnp.float32, impl="interpret")
    want = moe_gate_reference(x, attn, w[0], r[0], eps=EPS, dtype=jnp.float32)
    assert got[1].dtype == jnp.float32
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_what_it_cannot_serve_is_one_line_each():
    """Rows past `MAX_ROWS`, experts or widths off its blocks: one line each; "auto" falls back to the reference
    (on CPU it is the reference anyway), "interpret" refuses naming the problem; bad shapes are refused."""
    assert moe_gate_problems(1, 2048, 64) == []
    assert moe_gate_problems(5, 2048, 64) == ["T = 5 rows: the kernel loads 1 to 4 rows, a load each"]
    assert moe_gate_problems(1, 2048, 18) == ["E = 18 experts is not a multiple of the 4 columns a program computes"]
    assert moe_gate_problems(1, 1536, 16) == ["D = 1536 is not a multiple of the 1024-wide chunks the kernel walks"]
    x, attn, w, r = _inputs(MAX_ROWS + 1, 128, 16, 0)
    with pytest.raises(ValueError, match=r"^moe_gate impl='interpret': the kernels cannot serve this: T = 5 rows"):
        moe_gate(x, attn, w, r, 0, eps=EPS, impl="interpret")
    with pytest.raises(ValueError, match=r"^moe_gate: stacked weights need `layer`, got None$"):
        moe_gate(x, attn, w, r, eps=EPS, impl="reference")
    with pytest.raises(ValueError, match=r"^moe_gate: the attention rows must be \[T=5, D=128\] .*, got \(3, 128\)$"):
        moe_gate(x, attn[:3], w, r, 0, eps=EPS, impl="reference")
    parts = Partials(jnp.zeros((2, 4, 128)), (4, 128), jnp.dtype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^moe_gate: the attention rows must be Partials \[S, >= T=5, D=128\]"):
        moe_gate(x, parts, w, r, 0, eps=EPS, impl="reference")
    with pytest.raises(ValueError, match=r"^moe_gate: norm weight \[D=128\] and router \[D=128, E\]"):
        moe_gate(x, attn, w, r[0], 0, eps=EPS, impl="reference")


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_cross_lowers_for_sm90(name):
    """Traced and lowered for an H100 on a CPU host at V2-Lite's (one row, wo's 8 partials, 26 layers) and V3's (4
    rows, 7168 wide, 256 experts, 58 layers: a verify step's rows) shapes: one Triton call and no XLA
    dot or reduction beside it (catches an op the Triton lowering refuses, or the router's product left to XLA)."""
    from jax._src import mesh as mesh_lib

    T, D, E, L, S = {"v2_lite": (1, 2048, 64, 26, 8), "v3": (MAX_ROWS, 7168, 256, 58, 4)}[name]

    def f(x, parts, w, r, layer):
        return moe_gate(x, Partials(parts, (T, D), jnp.dtype(jnp.bfloat16)), w, r, layer, eps=EPS, impl="kernel")

    args = [((T, D), jnp.bfloat16), ((S, T, D), jnp.float32), ((L, D), jnp.float32), ((L, D, E), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in args] + [jax.ShapeDtypeStruct((), jnp.int32)]
    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=h100)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "stablehlo.dot_general" not in text and "stablehlo.reduce" not in text


def test_a_scanned_decode_step_enters_its_moe_layers_through_the_gate_kernel():
    """A scanned model's cached decode step with moe_impl="decode" on the interpret backend: each MoE layer's residual
    add, norm and router logits are one `moe_gate` call (one in the scan body), reading the layer's norm weight and
    router out of the whole stack, and the step's logits equal the reference backend's (XLA's add, norm and router
    dot). Catches the gate reading another layer's weights (each MoE layer's differ), its h and y swapped, and the
    stacks not passed whole to the scan's body."""
    from micro_configs import decode_step_on_both_backends, narrow_v2_lite

    from models import DeepSeekModel

    cfg = narrow_v2_lite(3).replace(hidden_size=128, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=16)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0), moe_impl="decode")
    (got, jaxpr), (want, _) = decode_step_on_both_backends(model)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
    assert jaxpr.count("name=moe_gate") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", gpu_full(["v2_lite", "v3", "v2_lite_rows", "builtin"], ["v2_lite", "v2_lite_rows"]))
def test_gpu_kernel_equals_the_reference(name):
    """The compiled kernel against the jnp reference at V2-Lite's decode step (one row, wo's 8 partials), V3's width
    and experts at 4 rows, V2-Lite's widths at `MAX_ROWS` summed rows (a verify step's), and the built-in model's 8
    experts."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    T, D, E, S = {
        "v2_lite": (1, 2048, 64, 8),
        "v3": (4, 7168, 256, 4),
        "v2_lite_rows": (MAX_ROWS, 2048, 64, 0),
        "builtin": (2, 128, 8, 0),
    }[name]
    x, attn, w, r = _inputs(T, D, E, S, L=4)
    got = jax.jit(lambda x, w, r: moe_gate(x, attn, w, r, jnp.int32(3), eps=EPS, impl="kernel"))(x, w, r)
    _assert_close(got, moe_gate_reference(x, attn, w, r, 3, eps=EPS))
