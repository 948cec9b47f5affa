"""The torch-free C++ benchmarks of the CPU attention loop (bench/cpu_attend_microbench.cpp,
bench/cpu_microkernel_rates.cpp) build against the current kernel headers and run. They are not
part of the extension, so nothing else would notice when a kernel change breaks them. Timings
are not checked (performance lives in bench/, not in tests); the loop's result is."""
import os
import platform
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                                reason="needs g++ on x86_64")


def _build(src, tmp_path):
    exe = str(tmp_path / os.path.basename(src).replace(".cpp", ""))
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    cmd = ["g++", "-O2", "-std=c++20", "-ffp-contract=fast", "-Wno-psabi", f"-I{ROOT}/csrc", f"-I{inc}",
           os.path.join(ROOT, "bench", src), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def test_attend_microbench_matches_softmax_sums(tmp_path):
    exe = _build("cpu_attend_microbench.cpp", tmp_path)
    Q, G, D, S = 3, 2, 37, 203
    r = subprocess.run([exe, str(Q), str(G), str(D), str(S), "5", "2", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"median ([0-9.]+) ms, ([0-9.]+) GFLOP/s \(acc0 (\S+), l0 (\S+)\)", r.stdout)
    assert m, r.stdout
    # l0: the softmax denominator of row 0 (query 0, head 0) over the last KV head, relative to its
    # running max; its inputs are the program's own deterministic fill (see the source)
    T = 2
    n = np.arange(T * S * D, dtype=np.uint64)
    k = ((n * np.uint64(2654435761)) % np.uint64(1000)).astype(np.float32) * np.float32(0.001) - np.float32(0.5)
    k = k.reshape(T, S, D)[T - 1]
    nq = np.arange(Q * G * D, dtype=np.uint64)
    q = ((nq * np.uint64(7919)) % np.uint64(1000)).astype(np.float32) * np.float32(0.0005) - np.float32(0.25)
    q0 = q.reshape(Q * G, D)[0].astype(np.float64)
    visible = S - Q + 1  # row 0 is query 0: position S - Q
    s = k[:visible].astype(np.float64) @ q0
    l0 = np.exp(s - s.max()).sum()
    assert float(m.group(4)) == pytest.approx(l0, rel=1e-4)


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="AVX-512 only")
def test_microkernel_rates_builds_and_runs(tmp_path):
    exe = _build("cpu_microkernel_rates.cpp", tmp_path)
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in ("fma (registers only)", "fma+bcast", "qk_pair_rows<3>", "pv_rows"):
        assert row in r.stdout
