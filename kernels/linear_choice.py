"""On a CPU, the layout and calls of each linear shape, chosen by timing the candidates on this host at load.

Why: the fastest CPU GEMM depends on the host (AVX2, AVX-512, AMX), the dtype and the token count, so a rule
written down from one host's measurements loses on another. For each weight shape and dtype, every layout this host
can hold is timed at COUNTS tokens through each call that layout serves:
  - cpp: the C++ operators' packed blocks (fp32 on AVX-512 builds, bf16/fp16 on AVX2 builds, bf16 in k-pairs on
    builds with AVX512-BF16), called as they are ("cpp") or unpacked for torch's GEMM ("cpp-unpacked",
    linear.dense_linear);
  - onednn: oneDNN's prepacked layout (`mkldnn._reorder_linear_weight`, what torch's CPU freezing path uses);
  - torch: the dense tensor for torch's `linear`, in the dtype ("torch") or, for bf16/fp16, widened to fp32 a slice
    at a time ("torch-fp32").
Each call is timed on weights read from memory, as a decode step reads them (between two calls of one weight, every
other layer's weights pass through the cache): the timed calls cycle through copies whose bytes together exceed the
last-level cache. Timed on one weight that stays in cache, a call that hides memory latency poorly looks as fast as
one that hides it well (perf/RESULTS.md, "bf16 on bf16 dot products").
The weight is held in one layout only (one copy of each weight): the one whose best call is least slow relative to
the best of all at each count, summed over the counts. Each token-count range then runs that layout's fastest call.
Where the written-down rule's layout or call (linear.static_layout) is within TIE of the fastest it is kept, so timing
noise on a shared host does not move a weight off today's path.

Choices are cached on disk (TRELLM_CACHE_DIR, default ~/.cache/trellm) keyed by CPU model, flags, torch version,
threads, dtype, shape, the layouts and calls this host offers and the timing method, so a restart reads them (and a
new candidate, such as a newly built operator, is timed); within a process each shape is timed once.
Only timings taken in quiet are trusted: while a shape is timed, the host's CPU time spent by other processes is read
from /proc/stat, and timings taken beside more than FOREIGN_CORES_MAX cores of other work, or out of order (a call
that took longer at fewer tokens than at more), are timed again after a pause, within QUIET_WAIT_S a process; past
that the weight takes the written-down rule and nothing is cached, so the next load times it again. A cached entry
out of order is timed again too.
TRELLM_CPU_LINEAR=cpp, onednn or torch forces today's static rule or a layout instead of `auto`.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from trellm_kernels import cpu_ops

log = logging.getLogger("trellm.linear")

COUNTS = (1, 4, 16, 64, 256)      # token counts timed
EDGES = (2, 8, 32, 128)           # a call of t tokens runs the choice of COUNTS[i], i = the first edge >= t
TIE = 0.10                        # a layout or call must be this much faster to replace the written-down rule's
MAX_TIMED_ELEMENTS = 4 << 20      # a larger weight is timed on its first output rows (a multiple of CPU_BLOCK)
HOPELESS = 4.0                    # a call this many times slower than the best is timed once at the next count
ROUNDS = 3                        # interleaved rounds of timing at each count
# How the entries were timed: part of the cache key, so entries timed an older way (one call after another, a median
# each, which a busy moment could skew for good; on one weight left in cache; or without watching for other work on
# the host) are timed again once.
TIMING = "timing interleaved-min streamed quiet"
STREAM_MAX_BYTES = 64 << 20       # the copies cycled by each call: twice the last-level cache, at most this much
MAX_COPIES = 64
LAYOUT_CALLS = {"cpp": ("cpp", "cpp-amx", "cpp-unpacked"), "onednn": ("onednn",), "torch": ("torch", "torch-fp32")}
FOREIGN_CORES_MAX = 0.3           # other processes' CPU use while a shape is timed, in cores, above which it is retimed
MIN_WATCH_S = 0.2                 # a timing shorter than this is watched this long (CPU time is counted in ticks)
QUIET_WAIT_S = 10.0               # per process: the time spent waiting for quiet and timing again, in all
ORDER_SLACK, ORDER_SLACK_US = 1.25, 2.0   # how much longer a call may take at fewer tokens than at more (noise)


def count_index(tokens: int) -> int:
    return next((i for i, edge in enumerate(EDGES) if tokens <= edge), len(EDGES))


@dataclass
class Choice:
    """A shape's layout, the call of each count range, and the timings behind them (microseconds per call, one
    list of len(COUNTS) per call timed)."""
    layout: str
    calls: tuple[str, ...]
    us: dict[str, list[float]] = field(default_factory=dict)
    timed_rows: int = 0                # output rows the timing used (fewer than the weight's for large weights)


def describe(layout: str, calls: tuple[str, ...]) -> str:
    """e.g. "cpp layout: cpp to 128 tokens, cpp-unpacked from 129"."""
    parts, start = [], 1
    for i, call in enumerate(calls):
        if i == len(calls) - 1 or calls[i + 1] != call:
            end = EDGES[i] if i < len(EDGES) else None
            parts.append(f"{call} " + ("at every count" if start == 1 and end is None else f"from {start}"
                                       if end is None else f"to {end} tokens" if start == 1 else f"{start}-{end}"))
            start = (end or 0) + 1
    return f"{layout} layout: {', '.join(parts)}"


def cpp_holds(dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether the C++ operators take a weight of this dtype and [out, in] shape on this host's build: outputs that
    fill 32-output blocks; fp32 on AVX-512, bf16/fp16 on AVX2 builds, bf16 with an even `in` on AVX512-BF16."""
    from trellm_kernels.linear import CPU_BLOCK
    ops = cpu_ops.for_tensor(torch.empty(0))
    if ops is None or shape[0] % CPU_BLOCK:
        return False
    if dtype == torch.float32:
        return bool(ops.avx512)
    if dtype == torch.bfloat16 and ops.avx512_bf16:
        return shape[1] % 2 == 0
    return bool(ops.avx2) and dtype in (torch.bfloat16, torch.float16)


def onednn_holds(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a prepacked GEMM for `dtype` here (fp32 always; bf16/fp16 where the CPU has their dot
    products)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return {torch.float32: lambda: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype, lambda: False)()


def layouts_for(dtype: torch.dtype, shape: tuple[int, int]) -> list[str]:
    return [layout for layout, ok in (("cpp", cpp_holds(dtype, shape)), ("onednn", onednn_holds(dtype)),
                                      ("torch", True)) if ok]


def amx_holds(dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether a bf16 weight of this [out, in] shape, held in k-pairs, can also run on AMX tiles here: an AMX-BF16
    build that Linux granted the tile state, and `in` a multiple of 32."""
    ops = cpu_ops.for_tensor(torch.empty(0))
    return (dtype == torch.bfloat16 and shape[1] % 32 == 0 and ops is not None and ops.avx512_bf16
            and ops.bf16_amx_ready())


def calls_of(layout: str, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[str, ...]:
    """The calls a weight of `dtype` and [out, in] `shape` held in `layout` can take here."""
    return tuple(c for c in LAYOUT_CALLS[layout] if (c != "torch-fp32" or dtype != torch.float32)
                 and (c != "cpp-amx" or amx_holds(dtype, shape)))


def decide(us: dict[str, list[float]], layouts: list[str], dtype: torch.dtype, static: str,
           static_calls: tuple[str, ...] = ()) -> Choice:
    """From the timings, the layout with the least summed slowdown against the best call at each count, and that
    layout's fastest call per count. `static` (today's layout) and `static_calls` (its call at each count) are kept
    unless another is faster by more than TIE."""
    best = [min(times[i] for times in us.values()) for i in range(len(COUNTS))]

    def calls_timed(layout: str) -> list[str]:
        return [c for c in LAYOUT_CALLS[layout] if c in us]

    def score(layout: str) -> float:
        return sum(min(us[c][i] for c in calls_timed(layout)) / best[i] for i in range(len(COUNTS)))

    chosen = min(layouts, key=score)
    if static in layouts and score(static) <= score(chosen) * (1 + TIE):
        chosen = static
    calls = []
    for i in range(len(COUNTS)):
        fastest = min(calls_timed(chosen), key=lambda c: us[c][i])
        today = static_calls[i] if chosen == static and static_calls else None
        calls.append(today if today in us and us[today][i] <= us[fastest][i] * (1 + TIE) else fastest)
    return Choice(chosen, tuple(calls), us)


def time_call(call: str, tokens: int, fn: Callable[[], object], quick: bool = False, budget_s: float = 0.02) -> float:
    """The fastest of up to 3 runs of fn() after one warm-up call (fewer for a slow call); `quick`: one run. The
    minimum, not the median: another process's work only ever adds time to a run."""
    if quick:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    fn()
    runs = []
    start = time.perf_counter()
    while len(runs) < 3 and (len(runs) < 1 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return min(runs)


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs reports for cpu0 (0 where it reports none)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def copies_to_stream(part_bytes: int) -> int:
    """How many copies of a timed weight of `part_bytes` the calls cycle through so that each reads its copy from
    memory: together twice the last-level cache (at most STREAM_MAX_BYTES and MAX_COPIES)."""
    target = min(STREAM_MAX_BYTES, 2 * last_level_cache_bytes())
    return max(1, min(MAX_COPIES, -(-target // max(1, part_bytes))))


def measure(w: torch.Tensor, layouts: list[str], timer) -> tuple[dict[str, list[float]], int]:
    """Microseconds of every call of `layouts` at each of COUNTS tokens, on the first rows of `w` (all of them
    unless the weight is larger than MAX_TIMED_ELEMENTS), and the rows timed. timer(call, tokens, fn, quick) ->
    seconds. At each count the calls are timed in ROUNDS interleaved rounds (the first with a warm-up and a few
    runs, the others one run each) and each keeps its fastest, so a burst of other work on the host (another model
    loading) slows one round of every call rather than all of one call's.
    A call HOPELESS times slower than the best at one count is timed once, `quick`, at the next: a call may still
    win at larger counts (widening a weight costs the same at any count), so none is skipped.
    Each run of a call takes the next of copies_to_stream copies of its layout, so it reads the weight from memory."""
    from trellm_kernels.linear import CPU_BLOCK, CALLS, hold
    rows = w.shape[0]
    if w.numel() > MAX_TIMED_ELEMENTS:
        rows = min(rows, max(CPU_BLOCK, MAX_TIMED_ELEMENTS // w.shape[1] // CPU_BLOCK * CPU_BLOCK))
    part = w[:rows].contiguous()
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, w.shape[1], generator=g).to(w.dtype) for n in COUNTS]
    copies = copies_to_stream(part.numel() * part.element_size())
    held = {layout: [hold(part if c == 0 else part.clone(), layout) for c in range(copies)] for layout in layouts}
    calls = [(call, itertools.cycle(held[layout])) for layout in layouts
             for call in calls_of(layout, w.dtype, tuple(w.shape))]
    us: dict[str, list[float]] = {call: [] for call, _ in calls}
    for i, x in enumerate(inputs):
        best = min(us[c][-1] for c, _ in calls) if i else 0.0
        quick = {c for c, _ in calls if i and us[c][-1] > HOPELESS * best}
        fastest = {c: float("inf") for c, _ in calls}
        for r in range(ROUNDS):
            for call, weights in calls[r % len(calls):] + calls[:r % len(calls)]:   # each round starts elsewhere
                if call in quick and r:
                    continue
                fn = CALLS[call]   # warmed up in the first round: later rounds time one run each
                seconds = timer(call, COUNTS[i], lambda x=x, fn=fn, weights=weights: fn(x, next(weights), None),
                                call in quick or r > 0)
                fastest[call] = min(fastest[call], seconds)
        for call, _ in calls:
            us[call].append(round(fastest[call] * 1e6, 1))
    return us, rows


def out_of_order(us: dict[str, list[float]]) -> list[str]:
    """The calls timed slower at some count than at a larger one (beyond ORDER_SLACK): more tokens never cost
    less, so such a table caught other work on the host."""
    bad = []
    for call, times in us.items():
        for i in range(len(times) - 1):
            later = min(times[i + 1:])
            if times[i] > ORDER_SLACK * later + ORDER_SLACK_US:
                bad.append(f"{call} {times[i]:g} us at {COUNTS[i]} tokens, {later:g} us at more")
                break
    return bad


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole host has spent busy since boot (/proc/stat; 0 where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class LoadWatch:
    """Other processes' CPU use while the block runs, in cores (`foreign_cores`): the host's busy time less this
    process's, over at least MIN_WATCH_S."""
    foreign_cores = 0.0

    def __enter__(self):
        self.start, self.busy, self.own = time.monotonic(), _cpu_busy_s(), time.process_time()
        return self

    def __exit__(self, *exc):
        left = MIN_WATCH_S - (time.monotonic() - self.start)
        if left > 0:
            time.sleep(left)
        foreign = (_cpu_busy_s() - self.busy) - (time.process_time() - self.own)
        self.foreign_cores = max(0.0, foreign) / (time.monotonic() - self.start)


_quiet_wait_left = [QUIET_WAIT_S]


def time_in_quiet(w: torch.Tensor, layouts: list[str], timer, static: str,
                  static_calls: tuple[str, ...]) -> tuple[Choice, str]:
    """The choice timed in quiet, and "" (cache it); or, when no quiet timing could be had within what is left of
    QUIET_WAIT_S, the written-down rule and why (do not cache it)."""
    while True:
        start = time.monotonic()
        with LoadWatch() as load:
            us, rows = measure(w, layouts, timer)
        disorder = out_of_order(us)
        if load.foreign_cores <= FOREIGN_CORES_MAX and not disorder:
            choice = decide(us, layouts, w.dtype, static, static_calls)
            choice.timed_rows = rows
            return choice, ""
        why = (f"other processes used {load.foreign_cores:.2f} cores while it was timed"
               if load.foreign_cores > FOREIGN_CORES_MAX else f"timings out of order ({'; '.join(disorder)})")
        pause = min(1.0, _quiet_wait_left[0])
        _quiet_wait_left[0] -= time.monotonic() - start + pause
        if pause <= 0 or _quiet_wait_left[0] < 0:
            calls = static_calls or tuple(calls_of(static, w.dtype, tuple(w.shape))[0] for _ in COUNTS)
            return Choice(static, calls, us, rows), why
        time.sleep(pause)


# -- the disk cache -----------------------------------------------------------------------------------------------
_lock = threading.Lock()
_memo: dict[str, Choice] = {}


def cache_file() -> str:
    root = os.environ.get("TRELLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trellm")
    return os.path.join(root, "linear-choice.json")


@functools.cache
def _host() -> str:
    """The cache key's host part, read once: /proc/cpuinfo is long on a large machine, and a mixture-of-experts model
    prepares thousands of weights."""
    flags = hashlib.sha256(cpu_ops._cpu_flags().encode()).hexdigest()[:12]
    return f"{cpu_ops.cpu_model()}|flags {flags}|torch {torch.__version__}"


def cache_key(dtype: torch.dtype, shape: tuple[int, int], layouts: list[str]) -> str:
    calls = " ".join(call for layout in layouts for call in calls_of(layout, dtype, shape))
    return (f"{_host()}|threads {torch.get_num_threads()}|{str(dtype).removeprefix('torch.')}|"
            f"{shape[0]}x{shape[1]}|calls {calls}|{TIMING}")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, key: str, choice: Choice) -> None:
    """Add one entry, atomically (several stubs may load models at once; a lost entry is only timed again)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read(path)
        data[key] = dict(layout=choice.layout, calls=list(choice.calls), us=choice.us, timed_rows=choice.timed_rows)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".linear-choice.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the linear choice in %s: %s", path, e)


def _from_cache(entry, layouts: list[str], dtype: torch.dtype, shape: tuple[int, int]) -> Choice | None:
    """A cached entry, if it still names a layout and calls this process can run."""
    try:
        choice = Choice(entry["layout"], tuple(entry["calls"]), dict(entry["us"]), int(entry.get("timed_rows", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    ok = (choice.layout in layouts and len(choice.calls) == len(COUNTS)
          and set(choice.calls) <= set(calls_of(choice.layout, dtype, shape)) and not out_of_order(choice.us))
    return choice if ok else None


def choose(w: torch.Tensor, static: str, static_calls: tuple[str, ...] = (), timer=None,
           path: str | None = None) -> Choice:
    """The choice for w's shape and dtype: this process's, else the disk cache's, else timed now (and cached).
    static, static_calls: the written-down rule's layout and its call at each of COUNTS (decide)."""
    layouts = layouts_for(w.dtype, tuple(w.shape))
    key = cache_key(w.dtype, tuple(w.shape), layouts)
    path = path or cache_file()
    with _lock:
        memo_key = f"{path}|{key}"
        if memo_key in _memo:
            return _memo[memo_key]
        choice = _from_cache(_read(path).get(key), layouts, w.dtype, tuple(w.shape))
        if choice is None:
            t = time.perf_counter()
            choice, not_quiet = time_in_quiet(w, layouts, timer or time_call, static, static_calls)
            rows = choice.timed_rows
            log.info("linear %dx%d %s timed in %.2f s (us at %s tokens%s): %s; holds %s%s",
                     w.shape[1], w.shape[0], str(w.dtype).removeprefix("torch."), time.perf_counter() - t,
                     "/".join(map(str, COUNTS)), "" if rows == w.shape[0] else f", first {rows} outputs",
                     "; ".join(f"{c} {'/'.join(f'{v:g}' for v in times)}" for c, times in choice.us.items()),
                     describe(choice.layout, choice.calls),
                     f" (the written-down rule, not cached: {not_quiet}; timed again at the next load)"
                     if not_quiet else "")
            if not not_quiet:
                _write(path, key, choice)
        _memo[memo_key] = choice
        return choice
