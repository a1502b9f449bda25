"""Timing shared by the benchmark scripts (run them from the repository root), and the
record of their results: with `KDEQX_RECORD=path`, each matched-cores row is also
appended to that JSON-lines file with the machine, JAX version, commit and command
(`benchmarks/table.py` turns `benchmarks/results.jsonl` into the table in
`benchmarks/README.md`)."""

import json
import os
import platform
import subprocess
import sys
import time


def best_of(fn, repeats=3):
    """The fastest of `repeats` calls of `fn`, each waited for (call it warm)."""
    import jax  # late: benchmarks/sharded.py sets XLA_FLAGS before JAX starts

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def compile_time(make_jitted, *args):
    """Seconds to trace, lower and compile a fresh `make_jitted()` (a new `jax.jit`
    or `eqx.filter_jit` function, so that no cache answers) for `args`, not run."""
    jitted = make_jitted()
    start = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - start


class cores:
    """A context that runs this process (every thread of it: XLA's, OpenMP's) on the
    given CPU cores only, as `taskset -c` would; `cores(None)` changes nothing."""

    def __init__(self, which):
        self.which = which

    def __enter__(self):
        import os

        self.before = os.sched_getaffinity(0)
        if self.which is not None:
            _pin_threads(set(self.which))
        return self

    def __exit__(self, *exc):
        _pin_threads(self.before)


def _pin_threads(which):
    import os

    for thread in _thread_ids():
        try:
            os.sched_setaffinity(thread, which)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def _thread_ids():
    import os

    return [int(t) for t in os.listdir("/proc/self/task")]


def core_settings():
    """`(label, cores)` for the two settings every table reports: all cores, then one
    (the process pinned to core 0). A process started under `taskset -c 0` has one
    core from the start, so XLA sizes its thread pools for one: it reports that
    setting only."""
    import os

    available = len(os.sched_getaffinity(0))
    if available == 1:
        return [("1 core", None)]
    return [(f"{available} cores", None), ("1 core", [0])]


def matched(implementations, repeats):
    """Per core setting, `(label, ours, best native, row)`: every implementation
    (`name -> fn`, ours named "kdeqx") timed best of `repeats` with those cores."""
    for label, which in core_settings():
        with cores(which):
            times = {name: best_of(fn, repeats) for name, fn in implementations.items()}
        ours = times.pop("kdeqx")
        row = " ".join(f"{name} {t:7.4f}s" for name, t in times.items())
        yield label, ours, min(times.values()), row


def print_matched(title, implementations, repeats, suffix="", task=None):
    """One line per core setting: ours, its ratio to the best native, every peer;
    recorded (`record`) as `task` (default `title`) where recording is on."""
    for label, ours, best, row in matched(implementations, repeats):
        print(
            f"{title} {label:>8} | kdeqx {ours:7.4f}s ({ours / best:5.2f}x best native)"
            f" | {row}{suffix}",
            flush=True,
        )
        record(f"{task or title.strip()}, {label}", ours, "best native", best)


def machine() -> str:
    """The CPU model and the cores this process may use, or the accelerator."""
    import jax

    if jax.default_backend() != "cpu":
        return f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if "model name" in line
            ]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def _commit() -> str:
    """`KDEQX_COMMIT`, else the checkout's short commit."""
    if os.environ.get("KDEQX_COMMIT"):
        return os.environ["KDEQX_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(task: str, ours: float, peer: str, theirs: float) -> None:
    """Appends one result to the file `KDEQX_RECORD` names (nothing if unset)."""
    path = os.environ.get("KDEQX_RECORD")
    if not path:
        return
    import jax

    row = {
        "task": task,
        "kdeqx_s": round(ours, 6),
        "peer": peer,
        "peer_s": round(theirs, 6),
        "machine": machine(),
        "jax": jax.__version__,
        "commit": _commit(),
        "command": " ".join(["python", *sys.argv]),
    }
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")
