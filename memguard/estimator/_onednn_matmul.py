"""oneDNN's matmul scratchpad: the bytes one bf16/fp16 ``mkldnn_matmul`` call allocates and frees.

PyTorch runs oneDNN in user-scratchpad mode, so each matmul allocates oneDNN's scratchpad through
the CPU allocator for the length of the call. Its size follows the implementation oneDNN picks and
that implementation's blocking. Everything here follows oneDNN v3.12 (tag v3.12, the version torch
2.13 bundles); paths are under ``src/``, and ``utils.cpp`` is
``cpu/x64/matmul/brgemm_matmul_utils.cpp``.

* Every booked buffer gets 128 bytes of alignment slack (``common/memory_tracking.hpp``,
  ``registry_t::book``), and the scratchpad is one allocation of their sum.
* ``avx512_core`` without a bf16 dot product runs ``gemm:jit:bf16``
  (``cpu/matmul/gemm_bf16_matmul.cpp``): one fp32 accumulator per thread, sized by
  ``gemm_based_common.hpp`` ``get_scratchpad_num_elements`` (the per-thread form; the single-call
  optimisation is never enabled in v3.12).
* Otherwise the brgemm matmul runs (``init_brgemm_matmul_conf``): per thread a batch-element array,
  a VNNI copy of a block of B (always for 16-bit weights, ``use_buffer_b``), a copy of a block of A
  when A is transposed (``is_copy_a_required``) or when a large power-of-two K makes oneDNN prefer
  it, and an fp32 C block (``is_buffer_c_required``, always for a 16-bit destination). The blocking
  is ``compute_blocking_heuristic_avx512`` (``compute_blocking_heuristic_avx2`` on ``avx2_vnni_2``),
  chosen by oneDNN's float32 imbalance score (``matmul_avx512_blocking_params_t::get_imbalance``).

Checked exactly (to the byte) against 938 real calls on an AVX-512 BF16 host at its own level and
at ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, 1 and 2 threads, all four transpose combinations, ``mm``,
``bmm``, ``addmm`` and ``linear``.

Known limitations:
    AMX (``avx512_core_amx``) chooses its blocks by a cache-size cost model
    (``amx_blocking_heuristics.cpp``) that is not modelled: its calls are sized with the
    ``avx512_core_bf16`` blocking, which is unmeasured on AMX hosts. The ``avx512_core_fp16`` and
    ``avx2_vnni_2`` paths follow the source and are unmeasured too (no such host was available).
"""

from __future__ import annotations

from dataclasses import dataclass

from memguard.estimator._onednn import BOOK_PAD, div_up, f32, rnd_up

_BATCH_ELEMENT = 40  # sizeof(brgemm_batch_element_t): cpu/x64/brgemm/brgemm_types.hpp


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _disbalance(work: int, parts: int) -> float:
    """``calculate_spatial_disbalance`` (utils.cpp)."""
    mod = work % parts
    share = (parts - mod) if work < parts else min(parts - mod, mod)
    return f32(share / parts)


@dataclass(frozen=True)
class _Problem:
    """One matmul as the blocking heuristic sees it: ``[batch,] [m, k] @ [k, n]`` on ``threads``."""

    m: int
    n: int
    k: int
    batch: int
    threads: int


def _imbalance(p: _Problem, m_blk: int, n_blk: int, n_chunk: int, k_blk: int, threads_k: int) -> float:
    """``matmul_avx512_blocking_params_t::get_imbalance`` (utils.cpp), in float32."""
    m, n, k, batch, threads = p.m, p.n, p.k, p.batch, p.threads
    mn_threads = threads // threads_k
    work = div_up(m, m_blk) * div_up(n, n_blk * n_chunk) * batch
    parallel = _disbalance(work, mn_threads)
    m_waste = f32(((m_blk * div_up(m, m_blk)) % m) / m)
    n_blocks = div_up(n, n_blk)
    n_waste = f32((div_up(n_blocks, n_chunk) * n_chunk - n_blocks) / n_blocks)
    k_waste = _disbalance(k, threads_k * k_blk)
    idle = f32((threads - mn_threads * threads_k) / threads) if mn_threads * threads_k != threads else 0.0
    total = f32(f32(f32(f32(parallel + m_waste) + n_waste) + idle) + k_waste)
    return f32(total / 5)


def _blocking(p: _Problem, n_blk: int, copy_a: bool, a_transposed: bool, ndims: int, avx2: bool,
              fp16: bool) -> tuple[int, int, int, int, int]:
    """``(m_blk, n_blk, n_chunk, k_blk, threads_k)``: ``compute_blocking_heuristic_avx512``
    (``_avx2`` for ``avx2_vnni_2``), 16-bit types only."""
    m, n, k, batch, threads = p.m, p.n, p.k, p.batch, p.threads
    max_m_blk, min_m_blk = min(256, m), min(32, m)
    n_chunks = div_up(n, n_blk)
    chunk_start = min(16 if copy_a else 1, n_chunks)
    k_blk = min(k, 1024) if avx2 or (k > 1024 and not a_transposed) else min(k, 512)
    threads_k = 1
    if threads > batch * n_chunks:  # low parallel work
        min_m_blk = min(m, 16)
        if (m <= 40 or (not avx2 and a_transposed and m <= 512)) and (n_chunks != 1 or ndims > 2):
            n_blk = min(n, 32)
        if not avx2 and batch == 1 and a_transposed and (fp16 or _is_pow2(k)) and k >= 2048:
            threads_k = min(threads, 4)  # the weight-gradient case: K split over threads
    best, best_score = None, 1.0
    for tk in range(threads_k, 0, -1):
        found = False
        for chunk in range(chunk_start, 0, -1):
            for m_blk in range(max_m_blk, min_m_blk - 1, -1):
                score = _imbalance(p, m_blk, n_blk, chunk, k_blk, tk)
                if not avx2:
                    work = batch * div_up(m, m_blk) * div_up(n, n_blk * chunk)
                    mn_threads = threads // tk
                    if work < mn_threads * 3 and work % mn_threads != 0 and threads_k == 1:
                        continue
                if score < best_score:
                    best, best_score, found = (m_blk, n_blk, chunk, k_blk, tk), score, True
        if not found and not avx2:
            score = _imbalance(p, min_m_blk, n_blk, 1, k_blk, tk)
            if score < best_score:
                best, best_score = (min_m_blk, n_blk, 1, k_blk, tk), score
    return best if best is not None else (min_m_blk, n_blk, 1, k_blk, 1)


def _brgemm_bytes(m: int, k: int, n: int, batch: int, a_transposed: bool, fp16: bool, isa: str,
                  threads: int) -> int:
    """The brgemm matmul's scratchpad (``init_aux_values`` and ``init_scratchpad``, utils.cpp)."""
    ndims = 3 if batch > 1 else 2
    if m == 1:
        a_transposed = False  # a one-row A is read as plain (treat_A_as_plain) ...
        src_ba = True  # ... but tagged 'ba' (matmul_utils.hpp transA), which caps k_blk at 512
    else:
        src_ba = a_transposed
    via_f32 = fp16 and isa != "avx2_vnni_2"  # f16 on avx512_core_fp16 is converted to f32 in the copies
    item = 4 if via_f32 else 2
    vnni = 1 if via_f32 else 2
    wei_k_blk = 16 * vnni  # get_wei_k_blk
    big_pow2_k = not a_transposed and _is_pow2(k) and k >= 8192 // 2  # lda_big_pow2
    copy_a = a_transposed or via_f32 or (not fp16 and isa != "avx2_vnni_2" and big_pow2_k and m >= 1024)
    wei_n_blk = 64  # get_default_n_block (non-AMX)
    m_blk, n_blk, chunk, k_blk, threads_k = _blocking(
        _Problem(m=m, n=n, k=k, batch=batch, threads=threads), min(wei_n_blk, n), copy_a, src_ba, ndims,
        isa == "avx2_vnni_2", fp16)
    if wei_n_blk > n_blk and n != n_blk:
        wei_n_blk = rnd_up(n_blk, 64 // (vnni * item))
    if copy_a:  # get_actual_lda
        lda = rnd_up(k_blk, 64 // item)
        if lda >= 512 and _is_pow2(lda):
            lda += 64 // item
    ldc = n_blk if threads_k <= 1 else n
    c_block = 4 * ldc * (m if threads_k > 1 else m_blk)
    c = c_block if threads_k > 1 or k_blk >= k else c_block * chunk
    a = item * m_blk * lda if copy_a else 0
    b = item * rnd_up(n_blk, wei_n_blk) * rnd_up(k_blk, wei_k_blk)
    per_thread = (16 * _BATCH_ELEMENT, a, b, c)
    return sum(threads * s + BOOK_PAD for s in per_thread if s > 0)


def _gemm_bf16_bytes(m: int, n: int, batch: int, threads: int) -> int:
    """``gemm:jit:bf16``'s fp32 accumulator (``get_scratchpad_num_elements``, per-thread form)."""

    def block(parts: int) -> int:
        share = div_up(batch * m * n, parts)
        size = min(m * n, share // n * n) if share >= n else share
        return rnd_up(size, 64)

    return 4 * max(block(1), threads * block(threads)) + BOOK_PAD


def matmul_scratchpad_bytes(m: int, k: int, n: int, *, batch: int = 1, a_transposed: bool = False,
                            b_transposed: bool = False, fp16: bool = False, isa: str = "avx512_core_bf16",
                            threads: int = 1) -> int:
    """Bytes of the scratchpad one ``mkldnn_matmul`` call of ``[batch,] [m, k] @ [k, n]`` allocates.

    Args:
        m, k, n, batch: the problem as ATen passes it (``batch`` > 1 for ``bmm``).
        a_transposed, b_transposed: the operand is a transposed view (oneDNN's ``ba`` layout).
        fp16: float16 operands (else bfloat16).
        isa: a level of :data:`memguard.estimator._cpu_kernels.ISAS` that runs 16-bit matmuls in oneDNN.
        threads: intra-op threads.

    PyTorch hands a 2-d product with ``n == 1`` to oneDNN swapped (``(1, k, m)`` with the source
    transposed, as ``ONEDNN_VERBOSE`` shows); that is applied here.
    """
    if batch == 1 and n == 1 and m > 1:
        m, n, a_transposed, b_transposed = 1, m, True, not a_transposed
    if isa == "avx512_core":  # no bf16 dot product: gemm:jit:bf16 (fp16 never reaches oneDNN there)
        return _gemm_bf16_bytes(m, n, batch, threads)
    del b_transposed  # the brgemm buffers do not depend on B's layout
    level = "avx512_core_bf16" if isa == "avx512_core_amx" else isa  # see Known limitations
    return _brgemm_bytes(m, k, n, batch, a_transposed, fp16, level, threads)
