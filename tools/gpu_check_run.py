"""The scheduler of tools/gpu_check.sh: runs its steps in order under one global deadline (standard library only, so
it runs even where torch does not import).

Each step gets ``min(its limit, time left)``; a step whose floor (``need``) no longer fits, or whose prerequisite did
not pass, is skipped and recorded as skipped. Before a step starts, a "started" marker goes to the live log and the
summary JSON, so a call killed mid-step still shows where it was. Every line a step prints is appended to one live
log at once, and the summary JSON (each step's status, seconds and the result files it wrote so far) is rewritten
every few seconds: what the device tool brings back from ``$OUT`` after a kill is current. The run ends by
printing one table of every step's figures, so the call's output tail carries them even if no file comes back.

    python -m tools.gpu_check_run --budget 450 --out OUT --results DIR --script tools/gpu_check.sh [STEP ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RESERVE_S = 5.0  # kept back from the budget for the summary after the last step
GRACE_S = 3.0  # between SIGTERM and SIGKILL of a step that ran out of time
MERGE_EVERY_S = 5.0
STEP_LOG_CAP = 3 << 20  # bytes of one step's output in the live log (the device tool returns files up to 16 MiB)
TAIL_LINES = 25
GENERIC_FIGURES = ("seconds", "peak_device_mb", "device")  # of quantize --json


@dataclass(frozen=True)
class Step:
    name: str
    limit: float  # seconds it may run
    need: float  # seconds below which it is not started
    after: tuple[str, ...] = ()  # steps that must have passed first


# The order is by value and risk: what has never run on a GPU and what everything else rests on comes first.
PLAN = (
    Step("env", 30, 5),
    Step("install", 90, 10),
    Step("smoke", 150, 30, ("install",)),  # 120 s ran out during its GPTQ run on an H100
    Step("kernels", 150, 40, ("install",)),
    Step("bench", 150, 40, ("install",)),
    Step("parity", 60, 20, ("install",)),
    Step("build7b", 90, 20, ("install",)),
    Step("rtn7b", 120, 30, ("build7b",)),
    Step("decode7b", 120, 40, ("rtn7b",)),
    Step("gptq8", 150, 45, ("install",)),
)


@dataclass
class Record:
    step: str
    status: str = "pending"  # running, ok, failed, timed_out, skipped
    rc: int | None = None
    seconds: float = 0.0
    limit_s: float = 0.0
    started_at_s: float | None = None  # since the start of the run
    reason: str | None = None
    log_tail: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)


class Run:
    """One run of a plan: the live log, the summary JSON and the deadline."""

    def __init__(self, out: Path, results: Path, budget: float, t0: float, header: dict) -> None:
        self.out, self.results, self.budget, self.t0 = out, results, budget, t0
        out.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        self.log = (out / "gpu_check.log").open("a", encoding="utf-8", errors="replace")
        self.summary_path = out / "gpu_check.json"
        self.header = header
        self.records: dict[str, Record] = {}
        self.lock = threading.Lock()

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def note(self, line: str, echo: bool = True) -> None:
        with self.lock:
            self.log.write(line + "\n")
            self.log.flush()
        if echo:
            print(line, flush=True)

    def merge_results(self, name: str) -> None:
        """Every JSON file the step wrote under ``results/NAME/`` (a partial one is skipped until complete)."""
        folder = self.results / name
        merged = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                merged[path.stem] = json.loads(path.read_text())
            except (json.JSONDecodeError, OSError):
                continue
        self.records[name].result = merged

    def write_summary(self, finished: bool = False) -> None:
        data = self.header | {
            "budget_s": self.budget,
            "elapsed_s": round(self.elapsed(), 1),
            "finished": finished,
            "steps": {name: vars(r) for name, r in self.records.items()},
        }
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(self.summary_path)


def _kill(proc: subprocess.Popen) -> None:
    """The step's whole process group: SIGTERM, then SIGKILL after the grace period."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _pump(proc: subprocess.Popen, run: Run, record: Record) -> None:
    """Copy the step's output into the live log line by line (up to STEP_LOG_CAP bytes), keeping the tail."""
    written = dropped = 0
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        record.log_tail = [*record.log_tail[-(TAIL_LINES - 1) :], line[:400]]
        if written + len(line) < STEP_LOG_CAP:
            written += len(line) + 1
            run.note(line, echo=False)
        else:
            dropped += 1
    if dropped:
        run.note(f"   ({dropped} more lines of {record.step} not logged: over {STEP_LOG_CAP >> 20} MiB)", echo=False)


def run_step(run: Run, step: Step, command: list[str], env: dict[str, str]) -> Record:
    record = run.records[step.name]
    left = run.left() - RESERVE_S - GRACE_S
    missing = [a for a in step.after if run.records.get(a) is None or run.records[a].status != "ok"]
    if missing:
        record.status, record.reason = "skipped", f"needs {', '.join(missing)} to pass first"
    elif step.need > left or left < 1:
        record.status, record.reason = "skipped", f"needs ~{step.need:.0f}s, {max(left, 0):.0f}s left"
    if record.status == "skipped":
        run.note(f"== [{run.elapsed():6.1f}s] SKIP {step.name}: {record.reason}")
        run.write_summary()
        return record
    timeout = min(step.limit, left)
    record.status, record.limit_s, record.started_at_s = "running", round(timeout, 1), round(run.elapsed(), 1)
    run.note(f"== [{run.elapsed():6.1f}s] START {step.name} (limit {timeout:.0f}s, {run.left():.0f}s of budget left)")
    run.write_summary()  # the started marker: a call killed now shows this step as running
    started = time.time()
    env = env | {"GPU_CHECK_DEADLINE": f"{started + timeout:.1f}", "GPU_CHECK_STEP": step.name}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc, run, record), daemon=True)
    pump.start()
    timed_out = False
    while True:
        try:
            proc.wait(timeout=min(MERGE_EVERY_S, max(0.05, started + timeout - time.time())))
            break
        except subprocess.TimeoutExpired:
            if time.time() >= started + timeout:
                timed_out = True
                _kill(proc)
                break
            run.merge_results(step.name)
            record.seconds = round(time.time() - started, 1)
            run.write_summary()
    pump.join(timeout=5)
    record.rc, record.seconds = proc.returncode, round(time.time() - started, 1)
    record.status = "timed_out" if timed_out else ("ok" if proc.returncode == 0 else "failed")
    run.merge_results(step.name)
    run.note(f"   [{run.elapsed():6.1f}s] {step.name}: {record.status} (rc {record.rc}) in {record.seconds}s")
    if record.status != "ok":
        for line in record.log_tail[-12:]:
            print(f"   | {line}", flush=True)
    run.write_summary()
    return record


def figures_of(record: Record) -> dict[str, object]:
    """The figures a step's result files name (``figures``), else their generic scalars (quantize's --json); each
    named after its file when the step wrote several."""
    figures: dict[str, object] = {}
    parts = {part: data for part, data in record.result.items() if isinstance(data, dict)}
    for part, data in parts.items():
        chosen = data.get("figures")
        if not isinstance(chosen, dict):
            chosen = {k: data[k] for k in GENERIC_FIGURES if k in data and not isinstance(data[k], (dict, list))}
        figures |= {(f"{part}.{k}" if len(parts) > 1 else k): v for k, v in chosen.items()}
    return figures


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_table(run: Run) -> str:
    lines = [
        f"GPU check summary: {run.header.get('device', '?')}, {run.elapsed():.0f}s of a {run.budget:.0f}s budget",
        f"{'step':<10} {'status':<10} {'seconds':>8} {'limit':>6}  note",
    ]
    for name, r in run.records.items():
        note = r.reason or ""
        lines.append(f"{name:<10} {r.status:<10} {r.seconds:>8.1f} {r.limit_s:>6.0f}  {note}")
        for key, value in figures_of(r).items():
            lines.append(f"{'':<12}{key}: {_fmt(value)}")
    return "\n".join(lines)


def run_plan(
    plan: tuple[Step, ...] | list[Step],
    command_for: Callable[[Step], list[str]],
    run: Run,
    env: dict[str, str] | None = None,
) -> dict[str, Record]:
    env = dict(os.environ if env is None else env)
    run.records = {s.name: Record(s.name, limit_s=s.limit) for s in plan}
    run.note(f"== GPU check: {len(plan)} steps, budget {run.budget:.0f}s, {run.left():.0f}s left at start")
    run.write_summary()
    for step in plan:
        run_step(run, step, command_for(step), env)
        if step.name == "env":  # the device's name, for the table's title
            run.header["device"] = run.records["env"].result.get("env", {}).get("figures", {}).get("device", "?")
    run.write_summary(finished=True)
    table = summary_table(run)
    run.note(table)
    print(f"results: {run.summary_path}", flush=True)
    return run.records


def scaled_plan(names: list[str], scale: float, overrides: dict[str, float]) -> list[Step]:
    """PLAN's steps named (all when none), limits and floors times ``scale``, a limit given by name replaced."""
    by_name = {s.name: s for s in PLAN}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown step {unknown[0]!r}; the steps are: {' '.join(by_name)}")
    chosen = [by_name[n] for n in names] if names else list(PLAN)
    return [
        Step(
            s.name,
            overrides.get(s.name, s.limit * scale),
            s.need * scale,
            tuple(a for a in s.after if a in names or not names),
        )
        for s in chosen
    ]


def limit_overrides(environ: dict[str, str]) -> tuple[float, dict[str, float]]:
    """``GPU_CHECK_LIMIT_SCALE`` (a fraction is fine) and ``GPU_CHECK_LIMIT_<STEP>`` seconds."""
    try:
        scale = float(environ.get("GPU_CHECK_LIMIT_SCALE", "1"))
        overrides = {
            k.removeprefix("GPU_CHECK_LIMIT_").lower(): float(v)
            for k, v in environ.items()
            if k.startswith("GPU_CHECK_LIMIT_") and k != "GPU_CHECK_LIMIT_SCALE"
        }
    except ValueError as exc:
        raise SystemExit(f"GPU_CHECK_LIMIT_* must be numbers of seconds (fractions allowed): {exc}") from None
    if scale <= 0:
        raise SystemExit(f"GPU_CHECK_LIMIT_SCALE must be positive, got {scale}")
    return scale, overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="*", help="steps to run, in plan order (default: all)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    parser.add_argument("--out", type=Path, required=True, help="where the live log and the summary JSON go")
    parser.add_argument("--results", type=Path, required=True, help="where steps write their result JSON")
    parser.add_argument("--script", type=Path, required=True, help="runs one step: SCRIPT --run-step NAME")
    parser.add_argument("--t0", type=float, default=None, help="when the call started (epoch seconds)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    scale, overrides = limit_overrides(dict(os.environ))
    names = [s.name for s in PLAN if s.name in args.steps] if args.steps else []
    if args.steps and len(names) != len(args.steps):
        scaled_plan(args.steps, scale, overrides)  # names the unknown step
    plan = scaled_plan(names, scale, overrides)
    run = Run(args.out, args.results, args.budget, args.t0 or time.time(), {"dry_run": args.dry_run})
    records = run_plan(plan, lambda step: ["bash", str(args.script), "--run-step", step.name], run)
    return 1 if any(r.status in ("failed", "timed_out") for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
