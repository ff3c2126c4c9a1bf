"""oneDNN failures under a real memory cap, for ``test_onednn_oom.py``.

Run as ``python onednn_oom_worker.py <out.json>``. The process caps its own address space with
``RLIMIT_AS`` at the current VmSize plus a small budget, runs a bfloat16 convolution whose oneDNN
primitive has not been created yet, and records what was raised and what ``is_oom_error`` said
while the cap was still in place (the guard classifies inside its ``except`` block, under the same
cap). It then does the same for oneDNN calls that fail for reasons that have nothing to do with
memory. Each case lifts the cap again before the next; the hard limit is never lowered, so it can.

Run it with ``MALLOC_ARENA_MAX=1`` (one heap for all threads), ``MALLOC_TOP_PAD_`` of 16 MiB (the
heap keeps that much mapped beyond its top, so that oneDNN's small allocations come from memory
mapped before the cap and only its own mappings, the JIT code buffers, meet the cap) and
``OMP_NUM_THREADS=1``. Without the pad, about one run in four crashed (SIGSEGV): oneDNN 3.12's
``c_compatible::operator new`` (src/common/nstl.hpp) returns the null of a failed malloc, and
``primitive_t``'s constructor then copies the primitive descriptor to it (``pd_t::clone``).

Cases, all recorded in the JSON file as lists of ``{"budget_kib", "type", "message", "oom", ...}``:

* ``forward``: ``F.conv2d`` in bfloat16 on a shape not seen before, so oneDNN must create the
  primitive, whose JIT kernels each map a 256 KiB code buffer, before PyTorch allocates the output.
* ``backward``: the forward ran before the cap; the backward's data and weight-gradient primitives
  are created under the cap, inside ``Tensor.backward``.
* ``poisoned``: one more such failure, after which the same thread, with the cap lifted, creates a
  primitive for another shape (``then``), and ``fresh_thread``: a new thread does the same.
* ``refusal``: adding two MKL-DNN tensors of different shapes (oneDNN's sum primitive refuses it:
  ``dnnl_invalid_arguments``), and, where the CPU has no float16 support, a float16 linear
  (``dnnl_unimplemented``), each with memory to spare and under a cap 16 MiB above VmSize.
* ``probe``: what ``_cannot_map`` says under a cap of 1 MiB above VmSize, and without it.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from memguard.guard._oom import _cannot_map, is_oom_error


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


SOFT, HARD = resource.getrlimit(resource.RLIMIT_AS)


def cap(budget_kib: int) -> None:
    """Cap the address space at VmSize + ``budget_kib`` (never above the hard limit)."""
    limit = vm_size() + (budget_kib << 10)
    resource.setrlimit(resource.RLIMIT_AS, (limit if HARD == resource.RLIM_INFINITY else min(limit, HARD), HARD))


def capped(budget_kib: int, fn, then=None) -> dict:
    """Run ``fn`` with the address space capped at VmSize + ``budget_kib``; classify what it raised.

    ``fn`` runs on a thread of its own, started before the cap (its stack is mapped then), since
    oneDNN 3.12's JIT keeps an Xbyak allocation error in a thread-local variable that nothing clears: a
    thread on which a JIT code buffer could not be mapped fails every later JIT primitive. ``then``,
    if given, runs on the same thread after the cap is lifted, and what it raised is recorded too.
    """
    rec: dict = {"budget_kib": budget_kib, "type": None, "message": None, "oom": None}

    def run() -> None:
        # Use torch and oneDNN once on this thread before the cap, so that what a thread allocates on
        # its first use of them (glibc's dynamic TLS, oneDNN's per-thread state) is not allocated
        # under it: without this, the first capped case crashed the process.
        F.conv2d(torch.ones(1, 8, 3, 3, dtype=torch.bfloat16), torch.ones(8, 8, 1, 1, dtype=torch.bfloat16))
        cap(budget_kib)
        try:
            fn()
        except Exception as exc:  # recorded for the test, which decides what was expected
            rec["oom"] = is_oom_error(exc)  # under the cap, as the guard would classify it
            resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))
            rec.update(type=type(exc).__name__, message=str(exc),
                       frames=[f.name for f in traceback.extract_tb(exc.__traceback__)],
                       oom_after_lifting_the_cap=is_oom_error(exc))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))
        if then is not None:
            try:
                then()
                rec["then"] = None
            except Exception as exc:  # recorded for the test
                rec["then"] = {"type": type(exc).__name__, "message": str(exc), "oom": is_oom_error(exc)}

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return rec


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dt = torch.bfloat16
    result: dict = {"bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    "fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported()}

    # The first backward imports torch.fx and sympy, and a backward with an explicit gradient imports
    # more: do both now, on a tiny float32 graph, so that nothing but oneDNN allocates in the cases.
    q = torch.randn(3, 3, requires_grad=True)
    (q * 2).backward(torch.ones(3, 3))

    # forward: 8 x 64 x (32 + i)^2 bfloat16 input, 64 3x3 filters; a new spatial size each time, so
    # each attempt creates its primitive under the cap (the output needs about 1 MiB).
    result["forward"] = []
    w = torch.randn(64, 64, 3, 3, dtype=dt)
    for i, budget in enumerate([0, 64, 192]):
        x = torch.randn(8, 64, 32 + i, 32 + i, dtype=dt)
        result["forward"].append(capped(budget, lambda: F.conv2d(x, w, padding=1)))

    # poisoned: after such a failure, the same thread, without a cap, creates a primitive for another
    # shape; then a fresh thread does the same
    x1, x2, x3 = (torch.randn(n, 64, h, h, dtype=dt) for n, h in [(8, 40), (2, 20), (2, 21)])
    result["poisoned"] = capped(64, lambda: F.conv2d(x1, w, padding=1), then=lambda: F.conv2d(x2, w, padding=1))
    result["fresh_thread"] = capped(1 << 30, lambda: F.conv2d(x3, w, padding=1))

    # backward: 1 x 64 x (8 + i)^2; the gradients need about 80 KiB, the primitives' JIT code more.
    result["backward"] = []
    for i, budget in enumerate([64, 256, 512]):
        x = torch.randn(1, 64, 8 + i, 8 + i, dtype=dt, requires_grad=True)
        w = torch.randn(64, 64, 3, 3, dtype=dt, requires_grad=True)
        y = F.conv2d(x, w, padding=1)
        g = torch.ones_like(y)
        result["backward"].append(capped(budget, lambda: y.backward(g)))

    # refusal: oneDNN's sum primitive needs equal shapes (src/common/sum.cpp: dnnl_invalid_arguments)
    a, b = torch.randn(2, 4).to_mkldnn(), torch.randn(1, 4).to_mkldnn()
    cases = {"sum of different shapes": lambda: a + b}
    if not result["fp16"]:  # no inner product implementation for float16 here: dnnl_unimplemented
        xh, wh = torch.randn(2, 4).half(), torch.randn(3, 4).half()
        cases["float16 linear"] = lambda: torch.ops.mkldnn._linear_pointwise(xh, wh, None, "none", [], "")
    result["refusal"] = []
    for name, fn in cases.items():
        for budget in [None, 16 << 10]:
            if budget is None:
                rec = capped(1 << 30, fn)  # 1 TiB: no cap that matters
                rec["budget_kib"] = None
            else:
                rec = capped(budget, fn)
            rec["case"] = name
            result["refusal"].append(rec)

    # probe: the cap makes both of the sizes the classifier asks for unavailable
    cap(1 << 10)
    capped_probe = {"small": _cannot_map(4 << 20), "large": _cannot_map(64 << 20)}
    resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))
    result["probe"] = {"capped": capped_probe, "free": {"small": _cannot_map(4 << 20),
                                                        "large": _cannot_map(64 << 20)}}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
