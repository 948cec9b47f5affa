"""Loader of the software emulation of the CUDA kernels (csrc/cuda/emu): the kernel
sources compiled as host C++ (-DVEGAS_EMULATE) with the same host logic (ops_host.h) as
the CUDA launchers, exposed on CPU tensors. Compiles once per source hash (~1 min on
2 cores, cached by torch.utils.cpp_extension); VEGAS_SKIP_EMULATOR=1 skips its tests.

Signatures (checks: 1 / 0 force the host-side value checks on / off, -1 = as on CUDA,
i.e. VEGAS_CUDA_VALUE_CHECKS; sms: emulated SM count; min_tiles: tiles per split, 1 = many
splits):
  verify_attention(q, k, v, seq_lens, block_size, scale, query_weights, simt, sms, checks, min_tiles)
  sparse_draft_attention(q, k, v, idx, tail, seq_lens, block_size, scale, simt, sms, checks, min_tiles)
  block_topk(scores, k, num_candidates, max_k, sinks, checks)
  workspace_bytes(op, B, Q, Hq, Hkv, D, S, block_size, K, dtype, aligned, sms, min_tiles)
  score_mode(B, Q, Hq, Hkv, D, S, block_size, dtype, aligned) -> "slots" | "score_pass"
  host_copies() -> device-to-host copies made so far (one blocking sync each on a GPU)
  mma_path(q, k) -> whether the tensor-core kernels apply
"""
import hashlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_EMU = None


def load_emulator():
    global _EMU
    if os.environ.get("VEGAS_SKIP_EMULATOR", "0") == "1":
        pytest.skip("VEGAS_SKIP_EMULATOR=1")
    if _EMU is None:
        from torch.utils import cpp_extension

        srcs = sorted((ROOT / "csrc" / "cuda").rglob("*")) + [ROOT / "csrc" / "checks.h"]
        h = hashlib.sha1()
        for p in srcs:
            if p.is_file() and p.suffix in (".h", ".cuh", ".cpp"):
                h.update(p.read_bytes())
        try:
            _EMU = cpp_extension.load(
                name=f"vegas_cuda_emu_{h.hexdigest()[:12]}",
                sources=[str(ROOT / "csrc" / "cuda" / "emu" / "emu_ops.cpp")],
                extra_include_paths=[str(ROOT / "csrc")],
                extra_cflags=["-DVEGAS_EMULATE", "-std=c++20", "-O1", "-g0"],
                verbose=False,
            )
        except Exception as e:  # no compiler / ninja: not the kernels' fault
            pytest.skip(f"could not build the kernel emulation: {e}")
    return _EMU
