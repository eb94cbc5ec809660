"""Timing shared by the Python benchmarks in scripts/ (bench_peers.py, bench_gemm.py)."""
import statistics
import time


def timed(function, repeats, warm_ups=1):
    """Median wall time of `repeats` calls of function(), after `warm_ups` untimed calls, in seconds."""
    for _ in range(warm_ups):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
