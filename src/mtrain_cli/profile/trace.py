"""Where a profiled step's GPU time and GPU idle go, from torch.profiler's chrome trace.

Each kernel (memcpy, memset) belongs to the CPU ranges open at its launch on the launching thread, and its phase
follows from them (`classify`): the marked ranges (`mtrain.plan`, `mtrain.attention`, `mtrain.optimizer`),
attention autograd nodes, then the kernel's own name. GPU idle is time with no kernel on any stream between the
window's first kernel and its last. Each gap is charged to the phase of the kernel that ended it (the host was
still launching that phase), and given a cause: a host wait that returned inside the gap drained the GPU, and the
host then had nothing queued; otherwise the host was slower at launching than the GPU at running. Host waits are
`*Synchronize` calls (`.item()`, `.tolist()`, an event's wait) and CPU collectives (`gloo:*`: the trainer's
scalars, which wait for the slowest rank's host).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mtrain_cli.attention import PLAN_RANGE

PHASES = ("attention", "plan", "matmul", "communication", "optimizer", "other")
ATTENTION_RANGE = "mtrain.attention"
OPTIMIZER_RANGE = "mtrain.optimizer"
ATTENTION_KERNEL_PREFIXES = (
    "_forward_kernel",
    "_dq_kernel",
    "_dkdv_kernel",
    "_vertical_kernel",
    "_fold_kernel",
    "_delta_kernel",
    "_probe_",
)  # ours
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "cudnn", "attention")  # SDPA backends
ATTENTION_NODES = ("AttentionFunctionBackward", "ScaledDotProduct")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul", "aten::linear")
COMM_NAMES = ("nccl", "gloo", "c10d::", "record_param_comms")


class Kernel(NamedTuple):
    start: float  # µs
    duration: float  # µs
    phase: str
    name: str
    launched_in: str = ""  # the innermost ranges open at its launch, innermost first ("a < b < c")


WAIT_CALLS = ("Synchronize",)  # cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize
CPU_COLLECTIVE_PREFIX = "gloo:"  # gloo:all_reduce etc., recorded on gloo's thread while the caller waits
CAUSE_DEPTH = 3  # enclosing ranges named in a cause, and the innermost marked (mtrain.*) range beyond them


def range_phase(names_innermost_first) -> str | None:
    """The phase of the innermost marked range or attention autograd node among these enclosing names: a plan
    runs inside the attention range."""
    for name in names_innermost_first:
        if name == PLAN_RANGE:
            return "plan"
        if name == ATTENTION_RANGE or any(n in name for n in ATTENTION_NODES):
            return "attention"
        if name == OPTIMIZER_RANGE:
            return "optimizer"
    return None


def classify(op_name: str, time_name: str, ancestor: str | None) -> str:
    """Phase of one unit of time: `time_name` is the kernel's name (GPU) or the op's (CPU), `op_name` the op
    that launched it, `ancestor` the phase of the marked range or autograd node around it."""
    lowered = time_name.lower()
    if any(n in lowered for n in COMM_NAMES) or any(n in op_name for n in COMM_NAMES):
        return "communication"
    if ancestor is not None:
        return ancestor
    if time_name.startswith(ATTENTION_KERNEL_PREFIXES) or any(n in lowered for n in ATTENTION_KERNEL_WORDS):
        return "attention"
    if op_name in GEMM_OPS or any(n in lowered for n in ("gemm", "xmma", "cutlass", "nvjet", "wgmma")):
        return "matmul"
    return "other"


def trace_kernels(events: list[dict]) -> list[Kernel]:
    """Every kernel, memcpy and memset of a chrome trace. A kernel belongs to the CPU ranges that enclose its
    launch on the launching thread. By time, not by the profiler's op tree: a CUDA graph's replay (a sparse
    plan's) is launched by no op of its own, and the tree files its kernels under an outer compiled region."""
    launches: dict[Any, list[tuple[float, Any]]] = {}  # thread -> (launch time, correlation id)
    for e in _runtime_calls(events):
        launches.setdefault(e["tid"], []).append((e["ts"], e["args"].get("correlation")))
    ranges = _ranges_by_thread(events)
    owners = {}  # correlation id -> the ranges enclosing its launch, innermost first
    for tid, mine in launches.items():
        owners.update(_enclosing(ranges.get(tid, []), sorted(mine, key=lambda launch: launch[0])))
    kernels = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        enclosing = owners.get(e["args"].get("correlation"), [])
        op_name = next((name for name, is_op in enclosing if is_op), "")
        phase = classify(op_name, e["name"], range_phase(name for name, _is_op in enclosing))
        kernels.append(Kernel(e["ts"], e["dur"], phase, e["name"], _chain(enclosing)))
    return kernels


def kernel_totals(kernels: list[Kernel], num_steps: int) -> dict[tuple[str, str], float]:
    """Milliseconds per step of each (phase, kernel name)."""
    totals: dict[tuple[str, str], float] = {}
    for _start, duration, phase, name, _launched_in in kernels:
        totals[(phase, name)] = totals.get((phase, name), 0.0) + duration / 1e3 / num_steps
    return totals


def idle_before(kernels: list[Kernel], num_steps: int) -> dict[str, float]:
    """Milliseconds per step the GPU ran nothing (no stream) between the window's first kernel and its last, each
    gap charged to the phase of the kernel that ended it: the host was still launching that phase (or reading
    a result back), so this is where a step is bound by the host, not the GPU."""
    idle: dict[str, float] = {}
    for gap_start, kernel in _gaps(kernels):
        idle[kernel.phase] = idle.get(kernel.phase, 0.0) + (kernel.start - gap_start) / 1e3 / num_steps
    return idle


def _gaps(kernels: list[Kernel]):
    """(start µs of a gap with no kernel on any stream, the kernel that ends it), by time."""
    busy_until = None
    for kernel in sorted(kernels):
        if busy_until is not None and kernel.start > busy_until:
            yield busy_until, kernel
        end = kernel.start + kernel.duration
        busy_until = end if busy_until is None else max(busy_until, end)


def _runtime_calls(events: list[dict]):
    return (e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"))


def _ranges_by_thread(events: list[dict]) -> dict[Any, list[tuple[float, float, str, bool]]]:
    """thread -> its CPU ops and marked ranges as (start, end, name, is an op)."""
    ranges: dict[Any, list[tuple[float, float, str, bool]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ranges.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"], e["cat"] == "cpu_op"))
    return ranges


def _enclosing(spans: list[tuple[float, float, str, bool]], launches: list[tuple[float, Any]]) -> dict[Any, list]:
    """One thread's nested spans (start, end, name, is an op) against its launches (time, id), both by time:
    id -> [(name, is an op)] of the spans open at that time, innermost first. One sweep with a stack."""
    spans = sorted(spans, key=lambda span: (span[0], -span[1]))
    found, stack, i = {}, [], 0
    for at, key in launches:
        while i < len(spans) and spans[i][0] <= at:
            while stack and stack[-1][1] < spans[i][0]:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1][1] < at:
            stack.pop()
        found[key] = [(name, is_op) for _start, _end, name, is_op in reversed(stack)]
    return found


def _chain(enclosing: list[tuple[str, bool]]) -> str:
    """The innermost CAUSE_DEPTH names, then the innermost marked range if it lies deeper: which of mtrain's
    phases the ops belong to (the same aten op launches in the plan and between steps)."""
    names = [name for name, _is_op in enclosing]
    shown = names[:CAUSE_DEPTH]
    marked = [name for name in names if name.startswith("mtrain.")]
    if marked and marked[0] not in shown:
        shown += ["…", marked[0]]
    return " < ".join(shown)


def host_waits(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, "call in ranges") of every host wait for the GPU or for other ranks in a chrome trace, by
    end."""
    waits: dict[Any, list[tuple[float, Any]]] = {}  # thread -> (call time, its index)
    calls = {}
    for index, e in enumerate(_runtime_calls(events)):
        if any(w in e["name"] for w in WAIT_CALLS):
            waits.setdefault(e["tid"], []).append((e["ts"], index))
            calls[index] = (e["ts"], e["ts"] + e["dur"], e["name"])
    ranges = _ranges_by_thread(events) if waits else {}
    found = []
    for tid, mine in waits.items():
        for index, enclosing in _enclosing(ranges.get(tid, []), sorted(mine, key=lambda wait: wait[0])).items():
            start, end, name = calls[index]
            found.append((start, end, f"{name} in {_chain(enclosing)}" if enclosing else name))
    found += [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(CPU_COLLECTIVE_PREFIX)
    ]
    return sorted(found, key=lambda wait: wait[1])


def idle_causes(kernels: list[Kernel], waits: list[tuple[float, float, str]], num_steps: int, count: int) -> list[list]:
    """The `count` largest causes of GPU idle as [cause, ms per step, gaps per step]: "after <wait>" where host
    waits returned inside the gap (the one that covered most of it), else "launching <ranges of the kernel that
    ended it>"."""
    causes: dict[str, list[float]] = {}
    next_wait = 0
    for gap_start, kernel in _gaps(kernels):
        while next_wait < len(waits) and waits[next_wait][1] < gap_start:
            next_wait += 1
        inside, index = [], next_wait
        while index < len(waits) and waits[index][1] <= kernel.start:
            start, end, name = waits[index]
            inside.append((end - max(start, gap_start), name))
            index += 1
        cause = f"after {max(inside)[1]}" if inside else f"launching {kernel.launched_in or kernel.name}"
        total = causes.setdefault(cause, [0.0, 0.0])
        total[0] += (kernel.start - gap_start) / 1e3 / num_steps
        total[1] += 1 / num_steps
    ranked = sorted(causes.items(), key=lambda item: -item[1][0])[:count]
    return [[cause, ms, gaps] for cause, (ms, gaps) in ranked]
