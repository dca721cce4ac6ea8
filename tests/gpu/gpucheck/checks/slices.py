"""Check 2, per framework: a kernel started by a real jupyter_server through the provisioner
allocates within its slice; past it the framework raises its out-of-memory error with
gpupool's message naming the slice; a second kernel's slice is unaffected.
"""

from __future__ import annotations

from functools import partial

from ..harness import HarnessError
from ..probe import Probe, first, need_framework, need_gpu, need_provisioner, need_server
from ..report import Result, Status
from . import CheckSpec, Context, Options
from .common import (
    GIB,
    SETUP,
    emit,
    framework_label,
    grant_problems,
    is_framework_oom,
    names_slice,
    nvml_process_memory,
    rest_slice,
    slice_server,
)

WITHIN = 0.6  # share of the slice each allocation asks for: one fits, two do not


def requires(key: str, probe: Probe, options: Options) -> str | None:
    return first(need_gpu(probe), need_framework(probe, key), need_server(probe), need_provisioner(probe))


def run(key: str, ctx: Context) -> Result:
    slice_bytes = ctx.options.slice_bytes
    chunk = int(slice_bytes * WITHIN)
    label = framework_label(key)
    data: dict[str, object] = {"slice": slice_bytes, "chunk": chunk}
    problems: list[str] = []
    server = slice_server(ctx.workdir, slice_bytes, f"server-{key}", ctx.log)
    try:
        server.start()
        # Both kernels are asked for before either is used: two concurrent slices.
        kid_a, kid_b = server.start_kernel(), server.start_kernel()
        a, b = server.connect(kid_a), server.connect(kid_b)
        for name, session in (("A", a), ("B", b)):
            problems += [f"kernel {name}: {p}" for p in grant_problems(session, slice_bytes)]
        data["env_a"], data["env_b"] = a.env, b.env
        if problems:
            return Result(ctx.name, Status.FAIL, detail="; ".join(problems)[:400], data=data)
        if a.env["GPUPOOL_LEASE_ID"] == b.env["GPUPOOL_LEASE_ID"]:
            problems.append("both kernels got the same lease id")
        for kid, tag in ((kid_a, "A"), (kid_b, "B")):
            body, note = rest_slice(server, kid)
            data[f"rest_{tag}"] = body or note
            if body is None:
                ctx.notes.append(note)
            elif body.get("state") != "granted" or int(body.get("memory") or 0) != slice_bytes:
                problems.append(f"REST says kernel {tag} is {body.get('state')} with {body.get('memory')} bytes")

        setup = a.run(SETUP[key] + emit("_gc_info()"), timeout=120)
        if not setup.ok:
            return Result.fail(ctx.name, f"{label} set-up failed in the kernel: {setup.brief()}", **data)
        data["info_a"] = setup.last()
        within = a.run(f"_gc_alloc({chunk})\n" + emit("_gc_info()"), timeout=60)
        if not within.ok:
            return Result.fail(
                ctx.name,
                f"allocating {chunk / GIB:.2f} GiB within the {slice_bytes / GIB:g} GiB slice failed: {within.brief()}",
                **data,
            )
        data["after_within"] = within.last()
        if a.pid:
            data["nvml_a_after_within"] = nvml_process_memory({a.pid}).get(a.pid)
        # Past the slice: the cell itself raises, so IPython (and gpupool's handler) sees it.
        beyond = a.run(f"_gc_alloc({chunk})", timeout=60)
        data["beyond"] = {
            "status": beyond.status,
            "ename": beyond.ename,
            "evalue": beyond.evalue[:500],
            "text": beyond.all_text[-1500:],
        }
        if beyond.ok:
            problems.append(
                f"a second {chunk / GIB:.2f} GiB ({2 * chunk / GIB:.2f} GiB in all) fitted in the {slice_bytes / GIB:g} GiB slice: not enforced"
            )
        elif not is_framework_oom(beyond.ename, beyond.evalue):
            problems.append(f"past the slice the error was not {label}'s out-of-memory error: {beyond.brief()}")
        elif not names_slice(beyond.all_text, slice_bytes):
            problems.append(
                f"{beyond.ename} raised, but no gpupool message naming the {slice_bytes / GIB:g} GiB slice in the cell output"
            )
        after = a.run("_gc_alloc(64 * 2**20)\n" + emit("_gc_info()"), timeout=60)
        if not after.ok:
            problems.append(f"kernel A could not allocate 64 MiB after its out-of-memory error: {after.brief()}")

        setup_b = b.run(SETUP[key] + f"_gc_alloc({chunk})\n" + emit("_gc_info()"), timeout=120)
        data["b"] = setup_b.last() if setup_b.ok and setup_b.data else setup_b.brief()
        if not setup_b.ok:
            problems.append(f"kernel B could not allocate {chunk / GIB:.2f} GiB in its own slice: {setup_b.brief()}")
        data["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **data)
    finally:
        server.stop()
    number = f"{slice_bytes / GIB:g} GiB slice: {chunk / GIB:.1f} ok, {2 * chunk / GIB:.1f} refused"
    return Result.verdict(
        ctx.name, problems, number=number, data=data,
        detail=lambda: f"{beyond.ename} with gpupool's message naming the slice; kernel B allocated {chunk / GIB:.1f} GiB in its own slice",
    )


SPECS = [
    CheckSpec(
        name=f"slices-{key}",
        title=f"{framework_label(key)} kernels on {'a slice'}: within ok, beyond OOM with our message, neighbour unaffected",
        requires=partial(requires, key),
        run=partial(run, key),
        timeout=150,
        min_seconds=40,
    )
    for key in ("torch", "jax", "cupy")
]
