"""A recorded trace as one self-contained HTML page: no server, no network.

Its first view (the header line, the token boxes, the selected token) is
written into the HTML here (:func:`first_view`), so the page shows it before
any script runs (a plain headless screenshot, a reader with scripts off);
trace.js then makes the tokens clickable and draws the lens, attention and the
family's panels.

The page is ``static/page.html`` with its style (``trace.css``), its script
(``trace.js``), the vendored charting library (``vendor/``: Chart.js and its
matrix plugin, see vendor/README.md) and the trace's data inlined, so that it
opens from a file anywhere and works offline.

What the data weighs, and how it is kept small:

* attention is the bulk (L layers x H heads x T²/2 weights). Each weight is
  stored as one byte, ``round(255 * sqrt(p))`` (steps of 0.4 % near 1 and much
  finer near 0, where most weights lie; the page squares it back), only the
  causal half of each T x T grid (row i: keys 0..i), gzip-compressed per layer
  and base64-encoded; the browser inflates it with its own ``DecompressionStream``.
  A layer in which an image's tokens read the later tokens of the same image
  (``lollm trace --image``: Gemma 3, Gemma 4's "vision" rule) also keeps those
  weights, each image's upper triangle (``ahead``, the same encoding);
* the logit lens keeps 5 tokens per layer and position, probabilities rounded to 4 digits;
* a family's internals are rounded to 4 significant digits.

:func:`decode_attention` reads a layer back exactly as the page does (the tests use it).
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import math
import os
import secrets
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from lollm.cli.trace.images import images_html

import torch

from lollm.errors import LollmError
from lollm.cli.trace.capture import Trace

_MARKERS = ("/*@CSS@*/", "/*@VENDOR@*/", "/*@SCRIPT@*/", "@DATA@", "@TITLE@", "@META@", "@TOKENS@", "@SELECTED@", "@IMAGES@")
#: how a token's whitespace is shown (as trace.js shows it in its tables): a space, a line break, a tab, a return
_VISIBLE = str.maketrans({" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"})
VENDOR_FILES = ("chart.umd.min.js", "chartjs-chart-matrix.min.js")


def _static(name: str) -> str:
    return resources.files("lollm.cli.trace").joinpath("static", name).read_text(encoding="utf-8")


def _vendor(name: str) -> str:
    """A vendored script without its ``//# sourceMappingURL`` line (the map is not shipped)."""
    text = resources.files("lollm.cli.trace").joinpath("vendor", name).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("//# sourceMappingURL="))


def _g(x: float, digits: int = 4) -> float | None:
    """A float rounded to ``digits`` significant digits, None for NaN or inf (JSON has neither)."""
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def encode_attention(probs: torch.Tensor) -> str:
    """(H, T, T) probabilities -> base64 of gzip of bytes round(255 sqrt(p)), the causal half of each head, row by row."""
    H, T, _ = probs.shape
    rows, cols = torch.tril_indices(T, T)
    half = probs[:, rows, cols].clamp(0, 1).sqrt().mul(255).round().to(torch.uint8)  # (H, T(T+1)/2)
    return base64.b64encode(gzip.compress(half.numpy().tobytes(), compresslevel=9, mtime=0)).decode("ascii")


def _ahead_index(spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the weights above the diagonal inside each image span ``[(start, end), ...]``:
    span by span, each span's strict upper triangle row by row (the order trace.js reads)."""
    rows, cols = [], []
    for start, end in spans:
        r, c = torch.triu_indices(end - start, end - start, 1)
        rows.append(r + start)
        cols.append(c + start)
    if not rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(rows), torch.cat(cols)


def encode_ahead(probs: torch.Tensor, spans: list[tuple[int, int]]) -> str | None:
    """(H, T, T) probabilities -> the weights an image's tokens give the *later* tokens of the same image
    (an image attended both ways: Gemma 3, Gemma 4's "vision" rule), encoded as :func:`encode_attention`;
    None when the layer gives them none (causal: no two-way image attention to show)."""
    rows, cols = _ahead_index(spans)
    ahead = probs[:, rows, cols]  # (H, U)
    if ahead.numel() == 0 or not bool((ahead > 0).any()):
        return None
    packed = ahead.clamp(0, 1).sqrt().mul(255).round().to(torch.uint8)
    return base64.b64encode(gzip.compress(packed.numpy().tobytes(), compresslevel=9, mtime=0)).decode("ascii")


def decode_attention(blob: str, heads: int, T: int, ahead: str | None = None,
                     spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """What the page reads back from :func:`encode_attention` (and :func:`encode_ahead` of ``spans``): (H, T, T)
    float32, 0 above the diagonal except inside an image attended both ways."""
    def unpack(text: str) -> torch.Tensor:
        raw = gzip.decompress(base64.b64decode(text))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).float().div(255).square().view(heads, -1)

    out = torch.zeros(heads, T, T)
    rows, cols = torch.tril_indices(T, T)
    out[:, rows, cols] = unpack(blob)
    if ahead is not None:
        rows, cols = _ahead_index(list(spans))
        out[:, rows, cols] = unpack(ahead)
    return out


def page_data(trace: Trace) -> dict[str, Any]:
    """The JSON the page is drawn from (see trace.js for how each field is used)."""
    data: dict[str, Any] = {
        "meta": trace.meta,
        "tokens": [{"id": i, "piece": p} for i, p in zip(trace.ids, trace.pieces)],
        "num_layers": trace.num_layers,
        "vocab": {str(k): v for k, v in trace.vocab.items()},
        "lens": None,
        "lens_missing": trace.lens_missing,
        "attention": [],
        "internals": [],
        "divergence": None,
    }
    if trace.lens is not None:
        lens = trace.lens
        data["lens"] = {
            "rows": ["embeddings"] + [f"layer {i}" for i in range(trace.num_layers)],
            "top_ids": lens.top_ids.tolist(),
            "top_probs": [[[round(p, 4) for p in pos] for pos in row] for row in lens.top_probs.tolist()],
            "next_probs": [[_g(p) for p in row] for row in lens.next_probs.tolist()],
            "next_ranks": lens.next_ranks.tolist(),
        }
    spans = [(view.start, view.end) for view in trace.images]
    data["image_spans"] = [list(span) for span in spans]
    for layer in trace.attention:
        data["attention"].append({
            "layer": layer.layer, "heads": layer.probs.shape[0], "window": layer.window,
            "data": encode_attention(layer.probs), "ahead": encode_ahead(layer.probs, spans),
        })
    for rec in trace.internals:
        entry: dict[str, Any] = {"name": rec.name, "kind": rec.kind, "note": rec.note, "where": rec.where,
                                 "layer": rec.layer, "labels": list(rec.labels)}
        for key, value in rec.data.items():
            if value.dtype.is_floating_point:
                entry[key] = [[_g(v) for v in row] for row in value.tolist()]
            else:
                entry[key] = value.tolist()
        data["internals"].append(entry)
    if trace.divergence is not None:
        d = trace.divergence
        rows = ["embeddings"] + [f"layer {i}" for i in range(trace.num_layers - 1)]
        rows += [f"layer {trace.num_layers - 1} + final norm", "logits"]
        data["divergence"] = {"rows": rows, "cosine": d.cosine, "max_abs": d.max_abs, "required": d.required,
                              "first": d.first, "reference": d.reference}
    return data


def visible(piece: str) -> str:
    """A token's text with its whitespace made visible (``∅`` for an empty one), as the page shows it."""
    return piece.translate(_VISIBLE) or "∅"


def _js(value: Any) -> str:
    """``value`` as JavaScript's ``JSON.stringify`` writes it (the page's own script uses the same form)."""
    return json.dumps(value, ensure_ascii=False)


def first_view(trace: Trace) -> dict[str, str]:
    """The HTML of what the page shows before any script runs: the header line, the token boxes
    (the last one selected) and the line about the selected token. Every text is escaped here.
    """
    meta = trace.meta or {}
    bits = [("model", meta.get("model")), ("family", meta.get("family")), ("format", meta.get("format")),
            ("dtype", meta.get("dtype")), ("tokens", str(len(trace.ids))), ("layers", str(trace.num_layers))]
    header = "   ".join(f"{k} <b>{html.escape(str(v))}</b>" for k, v in bits if v)
    last = len(trace.ids) - 1
    boxes = []
    for i, (token, piece) in enumerate(zip(trace.ids, trace.pieces)):
        title = html.escape(f"position {i} · id {token} · {_js(piece)}")
        boxes.append(f'<span class="tok{" selected" if i == last else ""}" data-pos="{i}" title="{title}">'
                     f'<span class="piece">{html.escape(visible(piece))}</span><sub>{token}</sub></span>')
    selected = ""
    if last >= 0:
        selected = html.escape(f"Selected: position {last}, id {trace.ids[last]}, {_js(trace.pieces[last])}; "
                               "the last token of the prompt.")
    return {"@META@": header, "@TOKENS@": "".join(boxes), "@SELECTED@": selected}


def render(trace: Trace) -> str:
    """The whole page as a string."""
    data = json.dumps(page_data(trace), ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    # inside <script>, "</" would end the element: JSON lets us escape it
    data = data.replace("</", "<\\/").replace("<!--", "<\\!--")
    title = html.escape(f"lollm trace · {trace.meta.get('model', '')}")
    page = _static("page.html")
    for marker in _MARKERS:
        if page.count(marker) != 1:
            raise LollmError(f"lollm trace: the page template must hold {marker} exactly once")
    vendor = "\n".join(_vendor(name) for name in VENDOR_FILES)
    parts = {"/*@CSS@*/": _static("trace.css"), "/*@VENDOR@*/": vendor, "/*@SCRIPT@*/": _static("trace.js"),
             "@DATA@": data, "@TITLE@": title, "@IMAGES@": images_html(trace.images), **first_view(trace)}
    # one pass, in the order the markers sit, so no inserted text is searched again
    out, rest = [], page
    for marker in sorted(parts, key=page.index):
        head, rest = rest.split(marker, 1)
        out += [head, parts[marker]]
    out.append(rest)
    return "".join(out)


def _kind(mode: int) -> str:
    """What a file of ``st_mode`` is, in words (for the error that refuses to replace it)."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                        (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def check_output(path: str | Path) -> Path:
    """The page's path, checked before anything is computed (and again just before the page replaces it).

    The page is written as a new file, or replaces a *regular* file. Raises
    LollmError for an empty path, a folder that does not exist or this user cannot write in, or a path that
    exists as anything else: a symbolic link (the page would not land where the
    link points, and never writes through one), a folder, a FIFO, a device node
    (``-o /dev/null`` as root would replace the device), a socket.
    """
    if str(path) == "":
        raise LollmError("lollm trace: -o/--output is empty: give the path of the page to write")
    path = Path(path)
    if not path.parent.is_dir():
        raise LollmError(f"lollm trace: the folder {path.parent} of --output does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise LollmError(f"lollm trace: cannot write in the folder {path.parent} of --output (no permission); "
                         f"give another path with -o")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise LollmError(f"lollm trace: cannot write {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise LollmError(f"lollm trace: {path} is {_kind(mode)}; the page replaces only a regular file: "
                         f"remove it or give another path with -o")
    return path


def write_page(trace: Trace, path: str | Path) -> int:
    """Write the page to ``path`` (its folder must exist); return its size in bytes.

    The page goes to a new temporary file beside ``path`` (a random name, created
    exclusively: never an existing file or link) and is renamed into place, so a
    failure never leaves half a page and never touches what was there.
    Raises LollmError when :func:`check_output` refuses ``path`` or the folder cannot be written.
    """
    path = check_output(path)
    text = render(trace).encode("utf-8")
    tmp = path.parent / f".{secrets.token_hex(8)}.lollm-trace.part"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as exc:
        raise LollmError(f"lollm trace: cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(text)
        check_output(path)  # what may have appeared there while the page was rendered
        os.replace(tmp, path)
    except OSError as exc:
        raise LollmError(f"lollm trace: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    return len(text)
