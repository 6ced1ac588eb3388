"""Where a training step's time goes: the hook's record of one step, and its summary.

A ``HookState(trace=True)`` records, per step, the time the training thread spends in
HiPress (each ``comm_hook`` call, and the wait at the end of backward for the step's
averages) and the engine's tasks (``casync.executor``: lane, name, start, end). With the
loop's own times of forward, backward and the optimizer, ``summarize`` says:

- ``hook_ms``: the hook's calls, on the autograd thread, inside backward;
- ``tail_ms``: the wait after backward's last gradient until every average landed, the
  part of the synchronization that nothing hides;
- ``codec_ms``: the compute lane's encodes, decodes and merges, and the inline averages;
- ``wire_ms``: the comm lane's waits for messages and allreduces (one per message, so
  several in flight add up);
- ``overlap``: the share of the synchronization's span (its first task's start to its
  last task's end) that lay before backward ended.

Example:
    >>> state = hp.HookState(algorithm="onebit", trace=True)
    >>> ...; loss.backward(); opt.step()
    >>> summarize(t_forward, t_backward, t_backward_end, t_end, state.take_trace())
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepTrace", "summarize", "COLUMNS"]

#: the summary's fields, in the order reports show them
COLUMNS = ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "hook_ms", "tail_ms",
           "codec_ms", "wire_ms", "overlap")


@dataclass
class StepTrace:
    """What one step recorded: (start, end) pairs of the hook's calls and of the wait at
    the end of backward, and the engine's tasks as ``(lane, task, graph, start, end)``."""

    hook: list[tuple[float, float]] = field(default_factory=list)
    tail: list[tuple[float, float]] = field(default_factory=list)
    tasks: list[tuple[str, str, str, float, float]] = field(default_factory=list)


def summarize(start: float, backward: float, backward_end: float, end: float,
              trace: StepTrace | None) -> dict[str, float]:
    """One step's breakdown (milliseconds; ``overlap`` a fraction) from the loop's times
    (step start, backward's start and end, step end; ``time.perf_counter``) and what the
    hook recorded for it (None: only the loop's times)."""
    ms = 1e3
    out = {"step_ms": (end - start) * ms, "forward_ms": (backward - start) * ms,
           "backward_ms": (backward_end - backward) * ms,
           "optimizer_ms": (end - backward_end) * ms}
    if trace is None:
        return out
    out["hook_ms"] = sum(b - a for a, b in trace.hook) * ms
    out["tail_ms"] = sum(b - a for a, b in trace.tail) * ms
    out["codec_ms"] = sum(e - s for lane, _, _, s, e in trace.tasks
                          if lane in ("compute", "inline")) * ms
    out["wire_ms"] = sum(e - s for lane, _, _, s, e in trace.tasks if lane == "comm") * ms
    if trace.tasks:
        first = min(s for _, _, _, s, _ in trace.tasks)
        last = max(e for _, _, _, _, e in trace.tasks)
        # backward's last gradient: where the tail wait began (else backward's end)
        finished = min((a for a, _ in trace.tail), default=backward_end)
        span = last - first
        out["overlap"] = min(max((finished - first) / span, 0.0), 1.0) if span > 0 else 1.0
    return out
