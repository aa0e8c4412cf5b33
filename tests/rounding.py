"""The one rule every kernel and operator test compares by: the answer of the PyTorch reference run in float64, and
a bound that follows the arithmetic, so a test passes on whatever order a build sums in (AVX2, AVX-512, portable
C++, the Triton interpreter, a GPU) and still fails on a wrong term.

An output y that sums n terms t_i in float32 is within about n * u * sum|t_i| of its exact value for every
summation order (u = eps / 2, the unit roundoff). A kernel that also rounds to a narrower type (bf16/fp16 products'
inputs, intermediates, its output) adds at most one eps of that type per rounding, relative to the same magnitude
(one eps also covers the Triton interpreter's truncating bf16 casts), or one subnormal step where the value is
that small. So a test asserts

    |actual - exact| <= (length * eps(float32) + roundings * eps(narrow)) * magnitude
                        + roundings * subnormal(narrow) * subnormal_gain

where `magnitude` is sum|t_i| of each output, computed in float64 from the same inputs, and `length` counts the
float32 roundings a term can pass through. That is twice the first-order worst case: loose for long sums of random
terms, which is why each test also has short cases (odd lengths, tails under a vector's width) where a dropped or
doubled term is far outside the bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS32 = torch.finfo(torch.float32).eps
# A few float32 roundings every output of the operators below may add besides its sums: a scale, a bias, a division
# by the softmax's sum, exp's polynomial (kernels/cpu/vec_math.h: within 2e-7 relative, under two eps).
FIXED_STEPS = 16


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@dataclass
class Exact:
    """An output's exact value, the sum of its terms' magnitudes, and the float32 roundings a term goes through
    (a number, or a tensor broadcast to the output's shape); `subnormal_gain`: what an intermediate's subnormal step
    becomes in the output (the other factor of a product formed after it; 1 where only the output is rounded)."""
    value: torch.Tensor
    magnitude: torch.Tensor
    length: torch.Tensor | float
    subnormal_gain: torch.Tensor | float = 1.0


def assert_within_rounding(actual: torch.Tensor, exact: Exact, narrow: torch.dtype | None = None,
                           roundings: int = 1) -> None:
    """`actual` is within the module's bound of `exact`; `narrow` is the narrowest type the computation rounds to
    (default: actual's dtype), `roundings` how many times a term or the output is rounded to it."""
    assert actual.shape == exact.value.shape, (actual.shape, exact.value.shape)
    narrow = narrow or actual.dtype
    # one rounding in the subnormal range is off by up to a subnormal step, whatever the magnitude
    subnormal = torch.finfo(narrow).tiny * eps(narrow)
    bound = ((exact.length * EPS32 + roundings * eps(narrow)) * exact.magnitude
             + roundings * subnormal * exact.subnormal_gain).expand(actual.shape)
    err = (actual.double() - exact.value).abs()
    bad = ~(err <= bound)          # a NaN fails too
    if bad.any():
        i = tuple(int(j) for j in torch.unravel_index((err - bound).nan_to_num(math.inf).argmax(), err.shape))
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs outside the rounding bound; at {i}: actual "
            f"{actual[i].item()!r}, exact {exact.value[i].item()!r}, error {err[i].item():.3g} > bound "
            f"{bound[i].item():.3g} (magnitude {exact.magnitude.expand(actual.shape)[i].item():.3g}, narrow {narrow}, "
            f"roundings {roundings})")


def exact_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 w_abs: torch.Tensor | None = None) -> Exact:
    """x @ w^T + bias, with w the weight's exact values (dequantized in float64 by the caller where quantized);
    `w_abs`: each weight's magnitude where an operator sums it as parts (default |w|)."""
    x64, w64 = x.double(), w.double()
    value, magnitude = x64 @ w64.T, x64.abs() @ (w64.abs() if w_abs is None else w_abs.double()).T
    if bias is not None:
        value, magnitude = value + bias.double(), magnitude + bias.double().abs()
    return Exact(value, magnitude, x.shape[-1] + FIXED_STEPS)


def exact_lora_add(out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, scale: float) -> Exact:
    """out + scale * (x @ at) @ bt: two sums, of K and then R terms."""
    x64, at64, bt64, out64 = x.double(), at.double(), bt.double(), out.double()
    value = out64 + scale * (x64 @ at64) @ bt64
    magnitude = out64.abs() + abs(scale) * (x64.abs() @ at64.abs()) @ bt64.abs()
    return Exact(value, magnitude, at.shape[0] + at.shape[1] + FIXED_STEPS)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps_: float) -> Exact:
    """weight * x / sqrt(mean(x^2) + eps), the reference in float64: the mean of squares sums positive terms, so
    its relative error (and the normalised value's) is the length's; the magnitude is the output's own."""
    from trellm_kernels import rmsnorm
    value = rmsnorm.rms_norm_reference(x.double(), weight.double(), eps_)
    return Exact(value, value.abs(), x.shape[-1] + FIXED_STEPS)


def exact_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> Exact:
    """x ([T, heads, D]) rotated by the reference in float64; a rotated value sums two products (x1 cos - x2 sin),
    columns past the rotated width pass through."""
    from trellm_kernels import rotary
    value, _ = rotary.rotary_reference(x.double(), x.double(), positions, cos_sin.double())
    rot = cos_sin.shape[1]
    cos, sin = cos_sin.double()[positions.long()].abs().chunk(2, dim=-1)
    c, s = torch.cat((cos, cos), dim=-1)[:, None], torch.cat((sin, sin), dim=-1)[:, None]
    xa = x.double().abs()
    x1, x2 = xa[..., :rot].chunk(2, dim=-1)
    magnitude = torch.cat((xa[..., :rot] * c + torch.cat((x2, x1), dim=-1) * s, xa[..., rot:]), dim=-1)
    return Exact(value, magnitude, 2 + FIXED_STEPS)


def exact_silu_and_mul(x: torch.Tensor) -> Exact:
    """silu(gate) * up, the reference in float64: no sum, a few roundings (exp, a division, two products); silu(gate)
    may be rounded to the dtype before the product, so its subnormal step is multiplied by |up|."""
    from trellm_kernels import activation
    value = activation.silu_and_mul_reference(x.double())
    return Exact(value, value.abs(), FIXED_STEPS, 1 + x.double().chunk(2, dim=-1)[1].abs())


def exact_gelu_tanh_and_mul(x: torch.Tensor) -> Exact:
    """gelu_tanh(gate) * up in float64, as g * sigmoid(y), y = 2 sqrt(2/pi) (g + 0.044715 g^3): the same function as
    0.5 g (1 + tanh(y / 2)), without the cancellation that form has where y is very negative (even in float64 it is
    then off by 1e-16 / (1 + tanh) relative). Otherwise as exact_silu_and_mul: products, no sum."""
    g, up = x.double().chunk(2, dim=-1)
    y = 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)
    value = g * torch.sigmoid(y) * up
    # y itself carries a few roundings (the cube, a multiply-add, the scale), each relative to |y|, and sigmoid's
    # relative change is at most the change of y: a relative error of up to 4 |y| eps where y is very negative
    return Exact(value, value.abs(), FIXED_STEPS + 4 * y.abs(), 1 + up.abs())


def exact_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k,
                    k_scale=None, v_scale=None, window=0, softcap=0.0) -> Exact:
    """paged_attention's answer from the reference in float64 (a quantized cache dequantized exactly first).

    Output o = sum_j w_j v_j with softmax weights w_j. A score q.k_j of D products is off by up to D u a_j,
    a_j = scale * sum|q||k_j|, which moves w_j by up to twice that relatively; the weighted sum adds one rounding per
    key. So a row's length is D * max_j a_j + its keys (plus the fixed steps), and its magnitude sum_j w_j |v_j|,
    the reference's answer on |v|. A soft cap's tanh has slope <= 1, so it moves no score error up, and adds a
    few roundings of its own, each relative to the cap: 8 softcap more to the length. A window only drops keys."""
    from trellm_kernels import attention, kv_cache
    if k_scale is not None:
        k_cache = kv_cache.dequantize_kv(k_cache, k_scale, torch.float64)
        v_cache = kv_cache.dequantize_kv(v_cache, v_scale, torch.float64)
    q64, k64, v64 = q.double(), k_cache.double(), v_cache.double()
    rest = (cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k)
    options = dict(window=window, softcap=softcap)
    value = attention.paged_attention_reference(q64, k64, v64, *rest, **options)
    magnitude = attention.paged_attention_reference(q64, k64, v64.abs(), *rest, **options)
    T, H, D = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = torch.zeros(T, H, 1, dtype=torch.float64)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n_keys in enumerate(lens):
        if cu[b + 1] == cu[b]:
            continue
        blocks = block_tables[b, :-(-n_keys // block_size)].long()
        keys = k64[blocks].reshape(-1, kv_heads, D)[:n_keys].abs().repeat_interleave(H // kv_heads, dim=1)
        a = scale * torch.einsum("nhd,lhd->nhl", q64[cu[b]:cu[b + 1]].abs(), keys).amax(dim=-1)
        length[cu[b]:cu[b + 1], :, 0] = D * a + n_keys + FIXED_STEPS + 8 * softcap
    return Exact(value, magnitude, length)


def exact_moe(x, w13, w2, weights, ids) -> Exact:
    """fused_moe's answer from the reference in float64 (w13, w2: the experts' exact weights, dequantized by the
    caller where quantized). An output sums, over its token's k experts, the routing weight times I products
    act_i * w2; each act = silu(g) * u comes from two sums of H products. Errors dg, du in those move act by at most
    1.1 |u| dg + |silu(g)| du (silu's slope lies in [-0.1, 1.1]), so the magnitude carried into the second sum is
    |act| + 1.1 |u| G + |silu(g)| U, with G and U the magnitudes of the first two sums."""
    from trellm_kernels import moe
    x64, w13_64, w2_64, weights64 = x.double(), w13.double(), w2.double(), weights.double()
    value = moe.fused_moe_reference(x64, w13_64, w2_64, weights64, ids)
    magnitude = torch.zeros_like(value)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        g, u = (x64[tokens] @ w13_64[e].T).chunk(2, dim=-1)
        G, U = (x64[tokens].abs() @ w13_64[e].abs().T).chunk(2, dim=-1)
        s = torch.nn.functional.silu(g)
        act = (s * u).abs() + 1.1 * u.abs() * G + s.abs() * U
        magnitude.index_add_(0, tokens, (act @ w2_64[e].abs().T) * weights64[tokens, slots, None].abs())
    return Exact(value, magnitude, x.shape[-1] + w2.shape[-1] + ids.shape[1] + FIXED_STEPS)
