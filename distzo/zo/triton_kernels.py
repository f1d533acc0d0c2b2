"""The Triton kernels of ``distzo.zo.triton_noise`` (imported only where Triton is).

Philox4x32-10 as in ``distzo.zo.philox`` (the reference), on a tile of 512 counters per
program; see ``triton_noise`` for what each kernel computes.

Offsets: Triton types an integer argument below 2^31 as int32, so ``start + n`` of two
such arguments wraps when it reaches 2^31 (a mask built on it is then false everywhere and
the program stores nothing). Element indices are int64 (``tile_words``) and every bound is
an offset compared with a length, ``e - start < n``, never a sum of arguments. The
offsets are int64 by annotation in any case (``SCALARS``).

Rounding: the kernels that consume several terms (``update``, the moments) hold a whole
tile, 8 lanes x 512 counters, as one [8, 512] block in registers, draw each term's z into
it and read and write every element once. They are compiled without fp fusion and spell
each fused multiply-add of the torch reference as ``tl.fma`` (torch's ``add(x, z,
alpha=a)`` and ``addcmul`` round once on the CPU and on CUDA), and use the correctly
rounded ``sqrt_rn``/``div_rn``: each result is then the reference's, bit for bit, on the
GPU and under the interpreter alike (from Triton 3.9: an older interpreter computes
``tl.fma`` as a multiply, then an add).
"""

import triton
import triton.language as tl

from distzo.zo import philox as definition

M0 = tl.constexpr(definition.M0)
M1 = tl.constexpr(definition.M1)
W0 = tl.constexpr(definition.W0)
W1 = tl.constexpr(definition.W1)
BF16_MAX = tl.constexpr(3.3895313892515355e38)  # bfloat16's largest finite value
F32 = tl.constexpr(tl.float32)  # a float32 master's dtype: ``nearest`` leaves its values be
# The kernels' scalar arguments change every step (keys) or every chunk (offsets): typed by
# annotation and never specialized, each kernel compiles once (per constexpr and pointer
# alignment), not once per key parity, divisibility by 16 or int32/int64 range.
SCALARS = [
    "start",
    "n",
    "k0",
    "k1",
    "uk0",
    "uk1",
    "scale",
    "alpha",
    "decay_end",
    "shrink",
    "num_terms",
    "beta1",
    "beta2",
    "one_minus_beta1",
    "one_minus_beta2",
    "eps",
    "neg_lr",
    "neg_step_size",
]


@triton.jit
def philox_block(counter, k0, k1):
    """Philox4x32-10 of counters (int64 values, counter words (low, high, 0, 0))."""
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, M0)
        lo0 = c0 * M0
        hi1 = tl.umulhi(c2, M1)
        lo1 = c2 * M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + W0
        k1 = k1 + W1
    return c0, c1, c2, c3


@triton.jit
def pick(w0, w1, w2, w3, index: tl.constexpr):
    if index == 0:
        return w0
    elif index == 1:
        return w1
    elif index == 2:
        return w2
    else:
        return w3


@triton.jit
def draw16(w0, w1, w2, w3, lane: tl.constexpr, table_ptr, KIND: tl.constexpr):
    """z of a 16-bit lane as float32: KIND 0 the Gaussian table, 1 Rademacher."""
    bits = (pick(w0, w1, w2, w3, lane // 2) >> (16 * (lane % 2))) & 0xFFFF
    if KIND == 0:
        return tl.load(table_ptr + bits.to(tl.int32))
    else:
        return tl.where((bits & 0x8000) != 0, 1.0, -1.0).to(tl.float32)


@triton.jit
def keys(k0, k1):
    return k0.to(tl.uint32), k1.to(tl.uint32)


@triton.jit
def tile_words(start, k0, k1, LANES: tl.constexpr, BLOCKS: tl.constexpr):
    """This program's tile: the element index of its lane 0 (lane j adds j * BLOCKS) and
    the four Philox words of each of its counters."""
    tile = (start // (BLOCKS * LANES) + tl.program_id(0)).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    k0, k1 = keys(k0, k1)
    w0, w1, w2, w3 = philox_block(tile * BLOCKS + b, k0, k1)
    return tile * (BLOCKS * LANES) + b, w0, w1, w2, w3


@triton.jit(do_not_specialize=SCALARS)
def fill_kernel(
    out_ptr,
    table_ptr,
    start: tl.int64,
    n: tl.int64,
    k0: tl.uint32,
    k1: tl.uint32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Draws of elements [start, start + n) into out[0:n] (KIND 2: uniform, 32-bit lanes)."""
    lanes: tl.constexpr = 4 if KIND == 2 else 8
    first, w0, w1, w2, w3 = tile_words(start, k0, k1, lanes, BLOCKS)
    for lane in tl.static_range(lanes):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        if KIND == 2:
            value = (pick(w0, w1, w2, w3, lane) >> 8).to(tl.float32) * (1.0 / 16777216.0)
        else:
            value = draw16(w0, w1, w2, w3, lane, table_ptr, KIND)
        tl.store(out_ptr + (e - start), value, mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def perturb_kernel(
    out_ptr,
    theta_ptr,
    table_ptr,
    start: tl.int64,
    n: tl.int64,
    k0: tl.uint32,
    k1: tl.uint32,
    scale: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """out <- theta + scale * z, one fused multiply-add (one rounding, as torch's
    ``add(theta, z, alpha=scale)``). A 16-bit theta (a model held in fp16 or bf16, its out
    of its dtype) takes ``noise.add_scaled``'s rule: z and ``scale`` (the wrapper's)
    rounded to its dtype, the sum formed in float32 and rounded to nearest even."""
    DT: tl.constexpr = theta_ptr.dtype.element_ty
    first, w0, w1, w2, w3 = tile_words(start, k0, k1, 8, BLOCKS)
    for lane in tl.static_range(8):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        theta = tl.load(theta_ptr + (e - start), mask=inside).to(tl.float32)
        z = nearest(draw16(w0, w1, w2, w3, lane, table_ptr, KIND), DT)
        out = nearest(tl.fma(z, scale, theta), DT)
        tl.store(out_ptr + (e - start), out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def nearest(x, DT: tl.constexpr):
    """float32 x rounded to nearest even in ``DT`` and back (exact; x itself for float32):
    a 16-bit master's value after each of torch's ops on it. bf16 by its bits (a correctly
    rounded conversion that the interpreter, which truncates, computes alike), NaN kept."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def tile_elements(start, BLOCKS: tl.constexpr):
    """This program's tile of 16-bit lanes as one block: its Philox counters [BLOCKS] and
    the element index of each lane of each counter [8, BLOCKS] (lane j: j * BLOCKS on)."""
    tile = (start // (BLOCKS * 8) + tl.program_id(0)).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    lane = tl.arange(0, 8)[:, None]
    return tile * BLOCKS + b, tile * (BLOCKS * 8) + lane * BLOCKS + b[None, :]


@triton.jit
def tile_z(counters, k0, k1, table_ptr, KIND: tl.constexpr):
    """z of a tile [8, BLOCKS] for one key: lane j is the 16-bit half j % 2 of word j // 2
    of its counter (``draw16``'s lanes, all eight at once)."""
    w0, w1, w2, w3 = philox_block(counters, k0.to(tl.uint32), k1.to(tl.uint32))
    lane = tl.arange(0, 8)[:, None]
    low = tl.where(lane < 2, w0[None, :], w1[None, :])
    high = tl.where(lane < 6, w2[None, :], w3[None, :])
    word = tl.where(lane < 4, low, high)
    bits = tl.where(lane % 2 == 1, word >> 16, word & 0xFFFF)
    if KIND == 0:
        return tl.load(table_ptr + bits.to(tl.int32))
    else:
        return tl.where((bits & 0x8000) != 0, 1.0, -1.0).to(tl.float32)


@triton.jit
def term(terms_ptr, j):
    """Term j of a launch's [K, 3] int32 table: its key (k0, k1) and alpha's float32 bits."""
    k0 = tl.load(terms_ptr + 3 * j).to(tl.uint32, bitcast=True)
    k1 = tl.load(terms_ptr + 3 * j + 1).to(tl.uint32, bitcast=True)
    alpha = tl.load(terms_ptr + 3 * j + 2).to(tl.float32, bitcast=True)
    return k0, k1, alpha


@triton.jit(do_not_specialize=SCALARS)
def update_kernel(
    theta_ptr,
    table_ptr,
    terms_ptr,
    num_terms: tl.int32,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """theta <- theta * shrink on [0, decay_end), then + alpha_j * z_j for each of the
    ``num_terms`` terms in order (one fused multiply-add each, as torch's ``add_(z,
    alpha=a)``): one read and one write of theta whatever the number of terms (a step's
    queries, or a recomputed momentum's window of steps times queries)."""
    DT: tl.constexpr = theta_ptr.dtype.element_ty
    counters, e = tile_elements(start, BLOCKS)
    inside = (e >= start) & (e - start < n)
    theta = tl.load(theta_ptr + (e - start), mask=inside, other=0.0).to(tl.float32)
    theta = updated(
        theta, counters, e, table_ptr, terms_ptr, num_terms, decay_end, shrink, KIND, DT
    )
    tl.store(theta_ptr + (e - start), theta.to(DT), mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def update_one_kernel(
    theta_ptr,
    table_ptr,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    alpha: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """``update_kernel`` with one term (ZO-SGD's step: one query, nothing pending), in the
    perturbation's shape: lane by lane, each lane's z drawn from its counter's words
    (``draw16``), no [8, BLOCKS] tile held and no table of terms read. The same operations
    on each element (the decay, then one fused multiply-add): the same bits."""
    DT: tl.constexpr = theta_ptr.dtype.element_ty
    first, w0, w1, w2, w3 = tile_words(start, k0, k1, 8, BLOCKS)
    for lane in tl.static_range(8):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        theta = tl.load(theta_ptr + (e - start), mask=inside).to(tl.float32)
        theta = lane_updated(
            theta, e, decay_end, shrink, w0, w1, w2, w3, alpha, lane, table_ptr, KIND, 1, DT
        )
        tl.store(theta_ptr + (e - start), theta.to(DT), mask=inside)


@triton.jit
def lane_updated(
    theta,
    e,
    decay_end,
    shrink,
    w0,
    w1,
    w2,
    w3,
    alpha,
    lane: tl.constexpr,
    table_ptr,
    KIND: tl.constexpr,
    TERM: tl.constexpr,
    DT: tl.constexpr,
):
    """One lane of a tile after an update of at most one term (``TERM``): the decay on
    [0, decay_end), then the term's fused multiply-add, its z from the counter's words
    ``w0..w3`` (``updated``'s arithmetic, lane by lane, for the one-term kernels)."""
    theta = tl.where(e < decay_end, nearest(theta * shrink, DT), theta)
    if TERM:
        z = nearest(draw16(w0, w1, w2, w3, lane, table_ptr, KIND), DT)
        theta = nearest(tl.fma(z, alpha, theta), DT)
    return theta


@triton.jit
def updated(theta, counters, e, table_ptr, terms_ptr, num_terms, decay_end, shrink, KIND, DT):
    """A tile of theta (float32 values) after an update: the decay on [0, decay_end), then
    each term's fused multiply-add in order (``update_kernel``'s arithmetic, wherever it
    runs). A master held in a 16-bit ``DT`` is rounded to it after each op, with z and
    alpha (the wrapper's) in it: ``NoiseSource.apply_terms``'s chunked path."""
    theta = tl.where(e < decay_end, nearest(theta * shrink, DT), theta)
    for j in range(num_terms):
        k0, k1, alpha = term(terms_ptr, j)
        z = nearest(tile_z(counters, k0, k1, table_ptr, KIND), DT)
        theta = nearest(tl.fma(z, alpha, theta), DT)
    return theta


@triton.jit
def rebuilt_tile(
    rest_ptr,
    table_ptr,
    terms_ptr,
    num_terms,
    start,
    n,
    decay_end,
    shrink,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """This program's tile of a 16-bit block's master, rebuilt from its values at rest:
    upcast, then ``updated``. Its counters, element indices and mask, and the values."""
    counters, e = tile_elements(start, BLOCKS)
    inside = (e >= start) & (e - start < n)
    theta = tl.load(rest_ptr + (e - start), mask=inside, other=0.0).to(tl.float32)
    theta = updated(
        theta, counters, e, table_ptr, terms_ptr, num_terms, decay_end, shrink, KIND, F32
    )
    return counters, e, inside, theta


@triton.jit(do_not_specialize=SCALARS)
def rebuild_perturb_kernel(
    out_ptr,
    rest_ptr,
    table_ptr,
    terms_ptr,
    num_terms: tl.int32,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    scale: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """out <- upcast(rest) after the update, + scale * z: a low-bit block's master rebuilt
    from its values at rest and perturbed in registers, one read of the 16-bit values and
    one write of the pass's scratch. Op for op the buffered path (the upcast copy,
    ``update_kernel``, ``perturb_kernel``), so the same bits."""
    counters, e, inside, theta = rebuilt_tile(
        rest_ptr, table_ptr, terms_ptr, num_terms, start, n, decay_end, shrink, KIND, BLOCKS
    )
    out = tl.fma(tile_z(counters, k0, k1, table_ptr, KIND), scale, theta)
    tl.store(out_ptr + (e - start), out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def rebuild_perturb_one_kernel(
    out_ptr,
    rest_ptr,
    table_ptr,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    uk0: tl.uint32,
    uk1: tl.uint32,
    alpha: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    scale: tl.float32,
    KIND: tl.constexpr,
    TERM: tl.constexpr,
    PART: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """``rebuild_perturb_kernel`` with at most one pending term (ZO-SGD's step: ``TERM``
    1, the term's key ``uk0, uk1`` and ``alpha``; 0 before the first update), in the
    perturbation's shape: lane by lane, each lane's two z drawn from its counter's words,
    no [8, BLOCKS] tile held and no table of terms read. The same operations on each
    element (the upcast, the decay, the term's fused multiply-add, the perturbation's):
    the same bits. ``PART`` 1: ``rest`` and ``out`` hold elements [start, start + n) of
    the block (one module's, ``perturb_scope="module"``) and take those places' z; 0: the
    whole block from element 0 (``start`` unread: the index arithmetic and its registers
    compiled out of the pass the engine launches most)."""
    first, w0, w1, w2, w3 = tile_words(start * PART, k0, k1, 8, BLOCKS)
    _, u0, u1, u2, u3 = tile_words(start * PART, uk0, uk1, 8, BLOCKS)  # unused: TERM 0
    for lane in tl.static_range(8):
        e = first + lane * BLOCKS
        if PART:
            inside = (e >= start) & (e - start < n)
            at = e - start
        else:
            inside = e < n
            at = e
        theta = tl.load(rest_ptr + at, mask=inside, other=0.0).to(tl.float32)
        theta = lane_updated(
            theta, e, decay_end, shrink, u0, u1, u2, u3, alpha, lane, table_ptr, KIND, TERM, F32
        )
        out = tl.fma(draw16(w0, w1, w2, w3, lane, table_ptr, KIND), scale, theta)
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def tile_ghat(counters, table_ptr, terms_ptr, num_terms, KIND: tl.constexpr):
    """A step's estimate ghat = sum_j alpha_j z_j on a tile, as ``MomentUpdater`` forms
    it: z_0 * alpha_0 (``torch.mul``), then one fused multiply-add per further query."""
    k0, k1, alpha = term(terms_ptr, 0)
    ghat = tile_z(counters, k0, k1, table_ptr, KIND) * alpha
    for j in range(1, num_terms):
        k0, k1, alpha = term(terms_ptr, j)
        ghat = tl.fma(tile_z(counters, k0, k1, table_ptr, KIND), alpha, ghat)
    return ghat


@triton.jit(do_not_specialize=SCALARS)
def momentum_kernel(
    theta_ptr,
    m_ptr,
    table_ptr,
    terms_ptr,
    num_terms: tl.int32,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    beta1: tl.float32,
    neg_lr: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Stored momentum: m <- m * beta1 + ghat; theta <- theta * shrink on [0, decay_end),
    then + (-lr) * m. theta and m read once and written once, ghat never stored."""
    counters, e = tile_elements(start, BLOCKS)
    inside = (e >= start) & (e - start < n)
    ghat = tile_ghat(counters, table_ptr, terms_ptr, num_terms, KIND)
    m = tl.load(m_ptr + (e - start), mask=inside, other=0.0)
    theta = tl.load(theta_ptr + (e - start), mask=inside, other=0.0)
    theta, m = momentum_rule(theta, m, ghat, e, decay_end, shrink, beta1, neg_lr)
    tl.store(m_ptr + (e - start), m, mask=inside)
    tl.store(theta_ptr + (e - start), theta, mask=inside)


@triton.jit
def momentum_rule(theta, m, ghat, e, decay_end, shrink, beta1, neg_lr):
    """Stored momentum's arithmetic (``MomentUpdater``'s ops): theta and m after a step."""
    m = m * beta1 + ghat
    theta = tl.where(e < decay_end, theta * shrink, theta)
    return tl.fma(m, neg_lr, theta), m


@triton.jit(do_not_specialize=SCALARS)
def momentum_one_kernel(
    theta_ptr,
    m_ptr,
    table_ptr,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    alpha: tl.float32,
    beta1: tl.float32,
    neg_lr: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """``momentum_kernel`` for one query (ghat = alpha z), in the perturbation's shape:
    lane by lane, z from the counter's words, no [8, BLOCKS] tile and no table of terms.
    The same operations on each element: the same bits."""
    first, w0, w1, w2, w3 = tile_words(0, k0, k1, 8, BLOCKS)
    for lane in tl.static_range(8):
        e = first + lane * BLOCKS
        inside = e < n
        ghat = draw16(w0, w1, w2, w3, lane, table_ptr, KIND) * alpha
        m = tl.load(m_ptr + e, mask=inside, other=0.0)
        theta = tl.load(theta_ptr + e, mask=inside, other=0.0)
        theta, m = momentum_rule(theta, m, ghat, e, decay_end, shrink, beta1, neg_lr)
        tl.store(m_ptr + e, m, mask=inside)
        tl.store(theta_ptr + e, theta, mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def adam_kernel(
    theta_ptr,
    m_ptr,
    v_ptr,
    table_ptr,
    terms_ptr,
    num_terms: tl.int32,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    beta1: tl.float32,
    beta2: tl.float32,
    one_minus_beta1: tl.float32,
    one_minus_beta2: tl.float32,
    eps: tl.float32,
    neg_step_size: tl.float32,
    KIND: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """MeZO-Adam: m <- m * beta1 + (1 - beta1) ghat; v <- v * beta2 + (1 - beta2) ghat^2;
    theta <- theta - step_size * m / (sqrt(v) + eps), then * shrink on [0, decay_end).
    torch's ops in ``MomentUpdater``'s order (``add_`` and ``addcmul_`` as one fused
    multiply-add each, ``addcdiv_`` as (value * m) / denom, then an add); theta, m and v
    read once and written once, ghat and the denominator never stored."""
    counters, e = tile_elements(start, BLOCKS)
    inside = (e >= start) & (e - start < n)
    ghat = tile_ghat(counters, table_ptr, terms_ptr, num_terms, KIND)
    m = tl.load(m_ptr + (e - start), mask=inside, other=0.0)
    m = tl.fma(ghat, one_minus_beta1, m * beta1)
    v = tl.load(v_ptr + (e - start), mask=inside, other=0.0)
    v = tl.fma(ghat * one_minus_beta2, ghat, v * beta2)
    denom = tl.sqrt_rn(v) + eps
    theta = tl.load(theta_ptr + (e - start), mask=inside, other=0.0)
    theta = theta + tl.div_rn(neg_step_size * m, denom)
    theta = tl.where(e < decay_end, theta * shrink, theta)
    tl.store(m_ptr + (e - start), m, mask=inside)
    tl.store(v_ptr + (e - start), v, mask=inside)
    tl.store(theta_ptr + (e - start), theta, mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def round_bf16_kernel(
    dst_ptr,
    src_ptr,
    start: tl.int64,
    n: tl.int64,
    k0: tl.uint32,
    k1: tl.uint32,
    BLOCKS: tl.constexpr,
):
    """dst (bf16) <- src (fp32) rounded stochastically, elements [start, start + n) of the
    bucket: the top 16 bits of each element's 32-bit uniform lane are added to the float's
    bit pattern and the low 16 bits cut (``offload.low_bit``'s rule; with its uniform
    u = (w >> 8) * 2^-24, int(u * 65536) is exactly w >> 16)."""
    first, w0, w1, w2, w3 = tile_words(start, k0, k1, 4, BLOCKS)
    for lane in tl.static_range(4):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        x = tl.load(src_ptr + (e - start), mask=inside).to(tl.float32)
        rounded = rounded_bf16(x, pick(w0, w1, w2, w3, lane))
        tl.store(dst_ptr + (e - start), rounded, mask=inside)


@triton.jit
def rounded_bf16(x, word):
    """x (float32) rounded stochastically to bfloat16 with its 32-bit uniform lane ``word``:
    the top 16 bits added to the float's pattern, the low 16 cut (saturating). A NaN stays
    NaN, as in the reference (Triton's min and max return the operand that is not NaN: the
    clamps alone would make it the largest finite value)."""
    clamped = tl.minimum(tl.maximum(x, -BF16_MAX), BF16_MAX)
    bits = (clamped.to(tl.int32, bitcast=True) + (word >> 16).to(tl.int32)) & -65536
    rounded = tl.minimum(tl.maximum(bits.to(tl.float32, bitcast=True), -BF16_MAX), BF16_MAX)
    return tl.where(x != x, x, rounded).to(tl.bfloat16)


@triton.jit
def tile_uniform_words(start, k0, k1, BLOCKS: tl.constexpr):
    """The 32-bit uniform lanes of this program's [8, BLOCKS] tile of elements
    (``tile_elements``'), as the round kernels draw them four lanes to a counter: lanes 0-3
    are the four words of the 4-lane tile 2t's counters, lanes 4-7 those of tile 2t + 1."""
    tile = (start // (BLOCKS * 8) + tl.program_id(0)).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    k0, k1 = keys(k0, k1)
    a0, a1, a2, a3 = philox_block(2 * tile * BLOCKS + b, k0, k1)
    c0, c1, c2, c3 = philox_block((2 * tile + 1) * BLOCKS + b, k0, k1)
    lane = tl.arange(0, 8)[:, None] % 4
    first = tl.where(
        lane < 2,
        tl.where(lane == 0, a0[None, :], a1[None, :]),
        tl.where(lane == 2, a2[None, :], a3[None, :]),
    )
    second = tl.where(
        lane < 2,
        tl.where(lane == 0, c0[None, :], c1[None, :]),
        tl.where(lane == 2, c2[None, :], c3[None, :]),
    )
    return tl.where(tl.arange(0, 8)[:, None] < 4, first, second)


@triton.jit(do_not_specialize=SCALARS)
def rebuild_round_kernel(
    dst_ptr,
    rest_ptr,
    table_ptr,
    terms_ptr,
    num_terms: tl.int32,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    KIND: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """dst <- upcast(rest) after the update, rounded stochastically back into the 16-bit
    format (MANTISSA 7: bfloat16, else ``round_low_bit_kernel``'s formats, dst as their
    integer bits): a low-bit block's write-back from its values at rest, the master never
    stored; ``rest`` and ``dst`` may be one buffer (each element is read before it is
    written, by the program that writes it). Op for op the upcast copy, ``update_kernel``
    and the round kernels, keyed (k0, k1) by the rounding's own key."""
    SIGN: tl.constexpr = 1 << (dst_ptr.dtype.element_ty.primitive_bitwidth - 1)
    counters, e, inside, theta = rebuilt_tile(
        rest_ptr, table_ptr, terms_ptr, num_terms, start, n, decay_end, shrink, KIND, BLOCKS
    )
    word = tile_uniform_words(start, k0, k1, BLOCKS)
    if MANTISSA == 7:
        out = rounded_bf16(theta, word)
    else:
        out = rounded_low_bit(theta, word, MANTISSA, BIAS, LIMIT, SIGN)
    tl.store(dst_ptr + (e - start), out.to(dst_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def rebuild_round_one_kernel(
    dst_ptr,
    rest_ptr,
    table_ptr,
    start: tl.int64,
    n: tl.int64,
    decay_end: tl.int64,
    shrink: tl.float32,
    uk0: tl.uint32,
    uk1: tl.uint32,
    alpha: tl.float32,
    k0: tl.uint32,
    k1: tl.uint32,
    KIND: tl.constexpr,
    TERM: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """``rebuild_round_kernel`` with at most one term (``TERM`` 1: its key ``uk0, uk1``
    and ``alpha``), lane by lane as ``rebuild_perturb_one_kernel``: each of the tile's 8
    lanes takes its z from its counter's words and its uniform from the words of the
    4-lane tiles 2t (lanes 0-3) and 2t + 1 (lanes 4-7), as ``tile_uniform_words`` lays
    them out. The same operations on each element: the same bits."""
    SIGN: tl.constexpr = 1 << (dst_ptr.dtype.element_ty.primitive_bitwidth - 1)
    # the term's words, unused (compiled out) at TERM 0; the tile's first element index
    first, w0, w1, w2, w3 = tile_words(start, uk0, uk1, 8, BLOCKS)
    tile = (start // (BLOCKS * 8) + tl.program_id(0)).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    r0, r1 = keys(k0, k1)
    a0, a1, a2, a3 = philox_block(2 * tile * BLOCKS + b, r0, r1)
    c0, c1, c2, c3 = philox_block((2 * tile + 1) * BLOCKS + b, r0, r1)
    for lane in tl.static_range(8):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        theta = tl.load(rest_ptr + (e - start), mask=inside, other=0.0).to(tl.float32)
        theta = lane_updated(
            theta, e, decay_end, shrink, w0, w1, w2, w3, alpha, lane, table_ptr, KIND, TERM, F32
        )
        if lane < 4:
            word = pick(a0, a1, a2, a3, lane)
        else:
            word = pick(c0, c1, c2, c3, lane - 4)
        if MANTISSA == 7:
            out = rounded_bf16(theta, word)
        else:
            out = rounded_low_bit(theta, word, MANTISSA, BIAS, LIMIT, SIGN)
        tl.store(dst_ptr + (e - start), out.to(dst_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def round_low_bit_kernel(
    dst_ptr,
    src_ptr,
    start: tl.int64,
    n: tl.int64,
    k0: tl.uint32,
    k1: tl.uint32,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """dst (the bits of float16 or float8 e4m3fn, as int16 or int8) <- src (float32)
    rounded stochastically, elements [start, start + n) of the bucket:
    ``offload.low_bit.round_stochastic_``'s rule, bit for bit (the nearest value, its
    neighbour on x's side by order key, that one when the uniform u < |x - nearest| /
    gap), in ``rounded_low_bit``'s integer form, u drawn in place: one read of src, one
    write of dst."""
    SIGN: tl.constexpr = 1 << (dst_ptr.dtype.element_ty.primitive_bitwidth - 1)
    first, w0, w1, w2, w3 = tile_words(start, k0, k1, 4, BLOCKS)
    for lane in tl.static_range(4):
        e = first + lane * BLOCKS
        inside = (e >= start) & (e - start < n)
        x = tl.load(src_ptr + (e - start), mask=inside, other=0.0).to(tl.float32)
        bits = rounded_low_bit(x, pick(w0, w1, w2, w3, lane), MANTISSA, BIAS, LIMIT, SIGN)
        tl.store(dst_ptr + (e - start), bits.to(dst_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rounded_low_bit(
    x,
    word,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    SIGN: tl.constexpr,
):
    """The bits of x (float32) rounded stochastically to a low-bit format with its 32-bit
    uniform lane ``word``: ``offload.low_bit.round_stochastic_``'s rule (the nearest value,
    ties to even; its neighbour on x's side; that one when u < |x - nearest| / gap) in
    integer and exact float ops on the magnitude (no conversion to the format: Triton's to
    fp8 needs compute capability 8.9; no division: the gap is a power of two).

    A normal magnitude's float32 bits, less the formats' exponent difference, are the code
    with SHIFT more bits below: the code truncated and the fraction ``low`` of an ulp. The
    nearest is the truncation or the next code up; x lies ``low`` (or ulp - ``low``) units
    of 2^-SHIFT ulp from it, so p = dist / 2^SHIFT exactly and u < p, with u = (word >> 8)
    / 2^24, is (word >> 8) < dist * 2^(24 - SHIFT) in integers. A subnormal one, in units
    of the smallest subnormal, is y exactly: its nearest integer (ties to even) and p =
    |y - nearest| exactly. The neighbour's sign is x's unless it is 0, which the rule's
    order key makes +0 (a nearest 0 keeps x's sign). A NaN is the format's NaN ``SIGN - 1``
    (all exponent and mantissa bits set), as in the reference, not the clamp's -LIMIT."""
    SHIFT: tl.constexpr = 23 - MANTISSA
    nan = x != x
    x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
    negative = x.to(tl.int32, bitcast=True) < 0  # -0.0 too: its nearest is -0
    a = tl.abs(x)
    c = a.to(tl.int32, bitcast=True) - ((127 - BIAS) << 23)  # the format's exponent bias
    normal = c >= (1 << 23)
    truncated = c >> SHIFT
    low = c & ((1 << SHIFT) - 1)
    rounded = (c + ((1 << (SHIFT - 1)) - 1) + (truncated & 1)) >> SHIFT  # ties to even
    down = rounded != truncated  # the nearest is above x: its neighbour on x's side below
    dist = tl.where(down, (1 << SHIFT) - low, low)
    picked = (word >> 8).to(tl.int32) < (dist << (24 - SHIFT))
    # subnormal: in units of the smallest, y < 2^MANTISSA (exact; capped where unused)
    y = tl.minimum(a * (1 << (BIAS - 1 + MANTISSA)), 1 << MANTISSA)
    nearest_y = (y + 8388608.0) - 8388608.0  # the integer nearest, ties to even
    off = y - nearest_y  # exact
    u = (word >> 8).to(tl.float32) * (1.0 / 16777216.0)
    code = tl.where(normal, rounded, nearest_y.to(tl.int32))
    step = tl.where(normal, tl.where(down, -1, 1), tl.where(off < 0, -1, 1))
    picked = tl.where(normal, picked, u < tl.abs(off))
    other = code + step
    rounded = tl.where(
        picked,
        tl.where(negative & (other > 0), other - SIGN, other),
        tl.where(negative, code - SIGN, code),
    )
    return tl.where(nan, SIGN - 1, rounded)
