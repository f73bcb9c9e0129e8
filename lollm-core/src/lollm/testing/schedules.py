"""The conformance kit's test prompt and the chunk schedules it feeds through a cache.

:class:`lollm.testing.conformance.FamilyConformance` makes a prompt of at least
:data:`SEQUENCE_LENGTH` positions (3 W + 2 with a sliding window W) and runs it through a
cache in the chunk sizes :func:`chunk_schedules` lists: one token at a time, uneven chunks,
prefills that end before, on and after a window's edge.
"""

from __future__ import annotations

from lollm.testing.coverage import DELTA_RULE_CHUNK

#: With a sliding window W, the test prompt has 3 W + 2 positions when that is at most this many.
MAX_WINDOWED_PROMPT = 128
#: The test prompt's positions at least: one-token decode steps past position 64
#: (:data:`lollm.testing.coverage.LONG_DECODE`) and a prefill past one delta-rule chunk, then decode.
SEQUENCE_LENGTH = 72


def sliding_window_of(config: dict[str, object]) -> int | None:
    """``sliding_window`` of a config.json dict (or of its ``text_config``), unless ``use_sliding_window`` is false."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            w = cfg.get("sliding_window")
            if isinstance(w, int) and not isinstance(w, bool) and w > 0 and cfg.get("use_sliding_window", True) is not False:
                return w
    return None


def fill_chunks(T: int, sizes: list[int]) -> list[int]:
    """Chunks of the sizes given, in turn, until they cover T positions (the last one cut)."""
    out: list[int] = []
    while sum(out) < T:
        out.append(min(sizes[len(out) % len(sizes)], T - sum(out)))
    return out


def chunk_schedules(T: int, window: int | None) -> list[list[int]]:
    """Chunk sizes the self-consistency test feeds through a cache, each summing to T.

    Always: one token at a time (decodes cross every boundary, and run past position 64),
    half then one at a time, chunks of 3 and 1; when T > 66, a prefill of 65 positions (past
    one chunk of the chunked delta rule) then one at a time. With a sliding window W: a prefill of W + 1 positions (it wraps
    around a ring of W slots) then one at a time, and chunks of W - 1, 1, W + 1 in turn
    (a chunk that ends just before the window's edge, a decode on the edge, a chunk
    that straddles it and must read keys a ring has since overwritten).
    """
    out = [[1] * T, [T // 2] + [1] * (T - T // 2), fill_chunks(T, [3, 1])]
    if T > DELTA_RULE_CHUNK + 2:  # a prefill past one chunk of the chunked delta rule, then decode
        out.append([DELTA_RULE_CHUNK + 1] + [1] * (T - DELTA_RULE_CHUNK - 1))
    if window and window + 1 < T:
        out += [[window + 1] + [1] * (T - window - 1), fill_chunks(T, [max(1, window - 1), 1, window + 1])]
    unique: list[list[int]] = []
    for schedule in out:
        if schedule not in unique:
            unique.append(schedule)
    return unique


def short_schedule(schedule: list[int]) -> str:
    """[5, 1, 1, 1] -> '[5, 1 x3]' (runs of one size written once)."""
    parts: list[str] = []
    i = 0
    while i < len(schedule):
        j = i
        while j < len(schedule) and schedule[j] == schedule[i]:
            j += 1
        parts.append(str(schedule[i]) if j - i == 1 else f"{schedule[i]} x{j - i}")
        i = j
    return "[" + ", ".join(parts) + "]"

