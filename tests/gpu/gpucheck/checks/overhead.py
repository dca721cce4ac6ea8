"""Check 5: what a slice costs. The same PyTorch matmul loop and small training loop run in a
kernel inside a slice and in a bare kernel (no pool), in alternating order, several times;
the ratio of median throughputs is reported (1.00 = no cost).
"""

from __future__ import annotations

import statistics

from ..harness import HarnessError, bare_kernelspec
from ..probe import Probe, first, need_framework, need_gpu, need_provisioner, need_server
from ..report import Result
from . import CheckSpec, Context, Options
from .common import emit, grant_problems, slice_server

MIN_RATIO = 0.95  # a slice may cost at most 5% throughput

SETUP = """
import time, torch
torch.backends.cuda.matmul.allow_tf32 = True
_gc_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
_gc_b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
_gc_model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
_gc_opt = torch.optim.AdamW(_gc_model.parameters(), lr=1e-4)
_gc_xb = torch.randn(512, 1024, device="cuda"); _gc_yb = torch.randn(512, 1024, device="cuda")
def _gc_matmul(n):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        _gc_c = _gc_a @ _gc_b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t) / 1e12  # TFLOP/s
def _gc_train(n):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        _gc_opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(_gc_model(_gc_xb), _gc_yb)
        loss.backward(); _gc_opt.step()
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t)  # steps/s
_gc_matmul(10); _gc_train(10)
""" + emit('{"device": torch.cuda.get_device_name(0)}')

MEASURE = emit('{"matmul": _gc_matmul(200), "train": _gc_train(100)}')


def requires(probe: Probe, options: Options) -> str | None:
    return first(need_gpu(probe), need_framework(probe, "torch"), need_server(probe), need_provisioner(probe))


def run(ctx: Context) -> Result:
    repeats = ctx.options.repeats
    data: dict[str, object] = {"repeats": repeats}
    problems: list[str] = []
    server = slice_server(
        ctx.workdir, ctx.options.slice_bytes, "server-overhead", ctx.log, kernelspecs=bare_kernelspec()
    )
    try:
        server.start()
        kid_slice, kid_bare = server.start_kernel(), server.start_kernel("python3-bare")
        sliced, bare = server.connect(kid_slice), server.connect(kid_bare)
        problems += grant_problems(sliced, ctx.options.slice_bytes)
        if bare.env.get("GPUPOOL_LEASE_ID"):
            problems.append("the bare kernel (local-provisioner kernelspec) got a lease too: no opt-out per kernelspec")
        if problems:
            return Result.fail(ctx.name, "; ".join(problems), **data)
        for session in (sliced, bare):
            warm = session.run(SETUP, timeout=120)
            if not warm.ok:
                return Result.fail(ctx.name, f"benchmark set-up failed: {warm.brief()}", **data)
        runs: dict[str, list[dict[str, float]]] = {"slice": [], "bare": []}
        for i in range(repeats):
            order = [("slice", sliced), ("bare", bare)] if i % 2 == 0 else [("bare", bare), ("slice", sliced)]
            for side, session in order:
                res = session.run(MEASURE, timeout=120)
                if not res.ok:
                    return Result.fail(ctx.name, f"{side} run {i + 1} failed: {res.brief()}", **data)
                runs[side].append(res.last())
        data["runs"] = runs
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("matmul", "train")} for side, rs in runs.items()}
        data["median"] = med
        ratios = {k: med["slice"][k] / med["bare"][k] for k in ("matmul", "train")}
        data["ratio"] = {k: round(v, 4) for k, v in ratios.items()}
        for k, v in ratios.items():
            if v < MIN_RATIO:
                problems.append(f"{k} throughput in the slice is {v:.3f}x bare (below {MIN_RATIO})")
        data["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **data)
    finally:
        server.stop()
    number = f"matmul {ratios['matmul']:.3f}x, train {ratios['train']:.3f}x"
    detail = (
        f"medians of {repeats}, alternated: matmul {med['slice']['matmul']:.0f} vs {med['bare']['matmul']:.0f} TFLOP/s, "
        f"train {med['slice']['train']:.0f} vs {med['bare']['train']:.0f} steps/s (slice vs bare)"
    )
    return Result.verdict(ctx.name, problems, number=number, detail=detail, data=data, noted="; " + detail, limit=None)


SPEC = CheckSpec(
    name="overhead",
    title="PyTorch matmul and training throughput in a slice vs bare",
    requires=requires,
    run=run,
    timeout=150,
    min_seconds=45,
)
