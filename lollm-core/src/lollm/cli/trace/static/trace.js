// lollm trace: draws one recorded forward pass (the JSON in #trace-data) with Chart.js.
// Data layout: lollm/trace/page.py (page_data). Every panel follows state.pos, the selected token.
"use strict";

(async function main() {
  const D = JSON.parse(document.getElementById("trace-data").textContent);
  const T = D.tokens.length;
  const state = { pos: T - 1, layer: null, head: "mean" };
  const charts = {};
  const $ = (id) => document.getElementById(id);
  Chart.defaults.animation = false;
  Chart.defaults.font.size = 11;

  // ---------------------------------------------------------------- helpers
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else if (k === "text") node.textContent = v;
      else node[k] = v;
    }
    for (const c of children) node.append(c);
    return node;
  }
  // a token's text with its whitespace made visible (a byte-level BPE's Ġ and Ċ arrive here as " " and "\n")
  function visible(piece) {
    return piece.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍") || "∅";
  }
  // long pieces (runs of spaces or dashes in code vocabularies) are cut for the tables; their title keeps them whole
  const short = (text, n = 14) => (text.length > n ? text.slice(0, n - 1) + "…" : text);
  const pieceOf = (id) => (D.vocab[String(id)] !== undefined ? D.vocab[String(id)] : "#" + id);
  const tokenLabel = (i) => i + " " + visible(D.tokens[i].piece);
  const pct = (p) => (p === null || p === undefined ? "–" : (100 * p).toFixed(p >= 0.1 ? 1 : 2) + "%");
  const blue = (p) => `rgba(37, 99, 235, ${Math.min(1, Math.max(0, p)).toFixed(3)})`;
  // ticks of a matrix axis on whole positions 0, step, 2 step ... (the cells span n - 0.5 .. n + 0.5)
  function integerTicks(n) {
    const step = Math.max(1, Math.ceil(n / 16));
    return (axis) => { axis.ticks = Array.from({ length: Math.ceil(n / step) }, (_, k) => ({ value: k * step })); };
  }
  function setChart(name, canvas, config) {
    if (charts[name]) {
      charts[name].data = config.data;
      charts[name].options = config.options;
      charts[name].update();
    } else {
      charts[name] = new Chart($(canvas), config);
    }
    return charts[name];
  }

  // ---------------------------------------------------------------- attention data
  async function inflate(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  const TRI = (T * (T + 1)) / 2;  // the causal half of a T x T grid, row by row
  // images attended both ways (page.py, encode_ahead): per image span [start, end), its strict upper
  // triangle row by row, the spans one after another; OFFSETS[k]: where span k starts in that list
  const SPANS = D.image_spans || [];
  const OFFSETS = [];
  let AHEAD = 0;
  for (const [s, e] of SPANS) { OFFSETS.push(AHEAD); AHEAD += ((e - s) * (e - s - 1)) / 2; }
  for (const a of D.attention) {
    a.bytes = await inflate(a.data);
    if (a.bytes.length !== a.heads * TRI) throw new Error(`attention of layer ${a.layer}: ${a.bytes.length} bytes, expected ${a.heads * TRI}`);
    delete a.data;
    if (a.ahead) {
      a.aheadBytes = await inflate(a.ahead);
      if (a.aheadBytes.length !== a.heads * AHEAD) throw new Error(`image attention of layer ${a.layer}: ${a.aheadBytes.length} bytes, expected ${a.heads * AHEAD}`);
      delete a.ahead;
    }
  }
  const attnByLayer = new Map(D.attention.map((a) => [a.layer, a]));
  const spanOf = (i) => SPANS.findIndex(([s, e]) => i >= s && i < e);  // the image holding position i, or -1
  // the last key query i reads: i itself, or the last token of its image in a layer that reads images both ways
  function lastKey(a, i) {
    const k = a.aheadBytes ? spanOf(i) : -1;
    return k < 0 ? i : SPANS[k][1] - 1;
  }
  // weight of query i on key j (j <= lastKey(a, i)), head h or the mean over heads; stored as round(255 sqrt(p))
  function weight(a, head, i, j) {
    let bytes = a.bytes, size = TRI, at = i * (i + 1) / 2 + j;
    if (j > i) {  // a later token of the same image
      const k = spanOf(i), n = SPANS[k][1] - SPANS[k][0], r = i - SPANS[k][0], c = j - SPANS[k][0];
      bytes = a.aheadBytes; size = AHEAD; at = OFFSETS[k] + r * n - (r * (r + 1)) / 2 + (c - r - 1);
    }
    if (head !== "mean") { const v = bytes[head * size + at] / 255; return v * v; }
    let s = 0;
    for (let h = 0; h < a.heads; h++) { const v = bytes[h * size + at] / 255; s += v * v; }
    return s / a.heads;
  }
  const outside = (a, i, j) => a.window !== null && j <= i - a.window;  // hidden by the sliding window

  // ---------------------------------------------------------------- header and tokens
  function renderMeta() {
    const m = D.meta || {};  // the header line (#meta) is in the page already: page.py writes it
    $("footer").textContent = `Made by lollm ${m.lollm_version || ""} · charts: Chart.js ${Chart.version} with chartjs-chart-matrix (MIT)` +
      (m.prompt_note ? " · " + m.prompt_note : "");
  }
  // the token boxes are in the page already (page.py writes them, so the first view needs no script): add the clicks
  function renderTokens() {
    document.querySelectorAll("#tokens .tok").forEach((node) => {
      node.addEventListener("click", () => select(Number(node.dataset.pos)));
    });
  }

  // ---------------------------------------------------------------- logit lens
  function renderLens() {
    const box = $("lens");
    if (!D.lens) {
      box.replaceChildren(el("p", { class: "note", text: "No logit lens: " + D.lens_missing }));
      $("lens-chart").parentElement.hidden = true;
      return;
    }
    const L = D.lens;
    const i = state.pos;
    const real = i + 1 < T ? D.tokens[i + 1].id : null;
    const head = el("tr", {}, el("th", { text: "after" }), ...[1, 2, 3, 4, 5].map((k) => el("th", { text: "#" + k })),
      el("th", { text: real === null ? "next token" : "next token " + JSON.stringify(D.tokens[i + 1].piece) }));
    const rows = L.rows.map((label, r) => {
      const cells = L.top_ids[r][i].map((id, k) => {
        const p = L.top_probs[r][i][k];
        const td = el("td", { class: "cand" + (id === real ? " real" : ""), "data-id": String(id), title: `id ${id}: ${pct(p)}` },
          short(visible(pieceOf(id))), el("small", { text: pct(p) }));
        td.title = `id ${id} ${JSON.stringify(pieceOf(id))}: ${pct(p)}`;
        td.style.background = blue(Math.sqrt(p) * 0.8);
        if (p > 0.45) td.classList.add("dark");
        return td;
      });
      const nextCell = real === null ? el("td", { class: "num", text: "(last token)" })
        : el("td", { class: "num", text: `${pct(L.next_probs[r][i])} · rank ${L.next_ranks[r][i] + 1}` });
      const tr = el("tr", { class: r === 0 ? "embed-row" : "layer-row", "data-row": String(r) },
        el("td", { text: label }), ...cells, nextCell);
      if (r > 0) {
        tr.setAttribute("data-layer", String(r - 1));
        if (state.layer === r - 1) tr.classList.add("picked");
        tr.addEventListener("click", () => pickLayer(r - 1));
      }
      return tr;
    });
    const caption = el("caption", { text: `position ${i}: after ${JSON.stringify(D.tokens[i].piece)}` +
      (real === null ? " (the last token: its prediction is what generation would produce)" : "") });
    box.replaceChildren(el("table", { "data-pos": String(i) }, caption, el("thead", {}, head), el("tbody", {}, ...rows)));
    const datasets = [{ label: "probability of the top token", data: L.rows.map((_, r) => L.top_probs[r][i][0]),
      borderColor: "#2563eb", backgroundColor: "#2563eb" }];
    if (real !== null) {
      datasets.push({ label: `probability of the real next token ${JSON.stringify(D.tokens[i + 1].piece)}`,
        data: L.rows.map((_, r) => L.next_probs[r][i]), borderColor: "#16a34a", backgroundColor: "#16a34a" });
    }
    setChart("lens", "lens-chart", {
      type: "line", data: { labels: L.rows, datasets },
      options: { maintainAspectRatio: false, scales: { y: { min: 0, max: 1, title: { display: true, text: "probability" } } } },
    });
  }

  // ---------------------------------------------------------------- attention
  function renderAttentionControls() {
    const layerSel = $("attn-layer"), headSel = $("attn-head");
    if (!D.attention.length) {
      $("attention-panel").replaceChildren(el("h2", { text: "Attention" }),
        el("p", { class: "note", text: "This model has no attention layer that recorded its weights." }));
      return false;
    }
    for (const a of D.attention) {
      const kind = a.window === null ? "global" : `sliding window ${a.window}`;
      layerSel.append(el("option", { value: String(a.layer), text: `layer ${a.layer} · ${a.heads} heads · ${kind}` }));
    }
    state.layer = D.attention[0].layer;
    layerSel.addEventListener("change", () => { state.layer = Number(layerSel.value); fillHeads(); renderAttention(); renderLens(); renderInternals(); });
    headSel.addEventListener("change", () => { state.head = headSel.value === "mean" ? "mean" : Number(headSel.value); renderAttention(); });
    fillHeads();
    return true;
  }
  function fillHeads() {
    const a = attnByLayer.get(state.layer);
    const headSel = $("attn-head");
    const keep = state.head;
    headSel.replaceChildren(el("option", { value: "mean", text: "mean of all heads" }),
      ...Array.from({ length: a.heads }, (_, h) => el("option", { value: String(h), text: "head " + h })));
    state.head = keep !== "mean" && keep < a.heads ? keep : "mean";
    headSel.value = String(state.head);
  }
  function renderAttention() {
    const a = attnByLayer.get(state.layer);
    if (!a) return;
    const i = state.pos;
    const keys = Array.from({ length: lastKey(a, i) + 1 }, (_, j) => j);
    const w = keys.map((j) => (outside(a, i, j) ? 0 : weight(a, state.head, i, j)));
    const top = keys.filter((j) => !outside(a, i, j)).sort((x, y) => w[y] - w[x]).slice(0, 3);
    const who = state.head === "mean" ? "the mean of its heads" : "head " + state.head;
    let text = `Layer ${a.layer}, ${who}: token ${i} ${JSON.stringify(D.tokens[i].piece)} reads most from ` +
      top.map((j) => `${j} ${JSON.stringify(D.tokens[j].piece)} (${w[j].toFixed(3)})`).join(", ") + ".";
    if (lastKey(a, i) > i) {
      text += ` Inside its image this layer reads both ways: keys ${i + 1}..${lastKey(a, i)} (orange) come after it.`;
    }
    if (a.window !== null) {
      text += i - a.window >= 0 ? ` Sliding window of ${a.window}: keys 0..${i - a.window} are outside it.`
        : ` Sliding window of ${a.window}: every earlier key is still inside it.`;
    }
    $("attn-summary").textContent = text;
    $("attn-summary").dataset.pos = String(i);
    $("attn-summary").dataset.layer = String(a.layer);
    const peak = Math.max(...w, 1e-6);
    const datasets = [{ label: "attention weight", data: w, backgroundColor: keys.map((j) => (j === i ? "#1d4ed8" : j > i ? "#f97316" : "#60a5fa")) }];
    if (a.window !== null && i - a.window >= 0) {
      datasets.push({ label: `outside the window (W = ${a.window})`, data: keys.map((j) => (outside(a, i, j) ? peak : null)),
        backgroundColor: "rgba(156, 163, 175, 0.35)" });
    }
    setChart("bars", "attn-bars", {
      type: "bar", data: { labels: keys.map(tokenLabel), datasets },
      options: { maintainAspectRatio: false, scales: { x: { stacked: true, ticks: { autoSkip: true, maxRotation: 60 } },
        y: { min: 0, title: { display: true, text: "weight" } } } },
    });
    renderHeatmap(a);
  }
  function renderHeatmap(a) {
    const cells = [];
    for (let i = 0; i < T; i++) {
      for (let j = 0; j <= lastKey(a, i); j++) cells.push({ x: j, y: i, v: outside(a, i, j) ? null : weight(a, state.head, i, j) });
    }
    const sel = state.pos;
    setChart("heatmap", "attn-heatmap", {
      type: "matrix",
      data: { datasets: [{
        label: `layer ${a.layer}`, data: cells,
        width: ({ chart }) => (chart.chartArea || {}).width / T, height: ({ chart }) => (chart.chartArea || {}).height / T,
        backgroundColor: ({ raw }) => (!raw ? "white" : raw.v === null ? "#d1d5db" : blue(Math.sqrt(raw.v))),
        borderColor: ({ raw }) => (raw && raw.y === sel ? "#f59e0b" : "rgba(0,0,0,0)"),
        borderWidth: ({ raw }) => (raw && raw.y === sel ? 1 : 0),
      }] },
      options: {
        maintainAspectRatio: false,
        onClick: (evt, items) => { if (items.length) select(items[0].element.$context.raw.y); },
        plugins: { legend: { display: false }, tooltip: { callbacks: {
          title: (items) => { const r = items[0].raw; return `query ${tokenLabel(r.y)} → key ${tokenLabel(r.x)}`; },
          label: (item) => (item.raw.v === null ? "outside the window" : "weight " + item.raw.v.toFixed(4)),
        } } },
        scales: {
          x: { type: "linear", min: -0.5, max: T - 0.5, offset: false, title: { display: true, text: "key position" }, afterBuildTicks: integerTicks(T) },
          y: { type: "linear", min: -0.5, max: T - 0.5, reverse: true, offset: false, title: { display: true, text: "query position" }, afterBuildTicks: integerTicks(T) },
        },
      },
    });
  }

  // ---------------------------------------------------------------- a family's own internals
  const groups = new Map();  // name -> records of that name, one per layer (or one for the model)
  for (const r of D.internals) { if (!groups.has(r.name)) groups.set(r.name, []); groups.get(r.name).push(r); }
  const groupLayer = new Map();  // name -> the record shown now
  function renderInternalsOnce() {
    const box = $("internals");
    if (!groups.size) {
      box.replaceChildren(el("p", { class: "note", text: "This family records nothing of its own beyond the panels above " +
        "(its layers are plain attention and feed-forward blocks; see docs/trace.md)." }));
      return;
    }
    let n = 0;
    for (const [name, recs] of groups) {
      const id = "rec" + n++;
      const div = el("div", { class: "family-record", "data-name": name, "data-kind": recs[0].kind });
      div.append(el("h3", { text: name }), el("p", { class: "help", text: recs[0].note }));
      if (recs.length > 1 && recs[0].kind !== "choice") {
        const sel = el("select", { id: id + "-layer" });
        recs.forEach((r, k) => sel.append(el("option", { value: String(k), text: r.layer === null ? r.where : "layer " + r.layer })));
        sel.addEventListener("change", () => { groupLayer.set(name, recs[Number(sel.value)]); renderInternals(); });
        div.append(el("div", { class: "controls" }, el("label", {}, "layer ", sel)));
      }
      groupLayer.set(name, recs[0]);
      div.append(el("div", { id: id + "-text" }), el("div", { class: "chart" }, el("canvas", { id: id + "-chart" })));
      recs.forEach((r) => { r.dom = id; });
      box.append(div);
    }
  }
  function renderInternals() {
    for (const [name, recs] of groups) {
      // follow the layer picked in the lens or the attention panel when this record has it
      const here = recs.find((r) => r.layer === state.layer);
      const sel = $(recs[0].dom + "-layer");
      if (here && sel) { sel.value = String(recs.indexOf(here)); groupLayer.set(name, here); }
      const r = groupLayer.get(name);
      if (r.kind === "series") renderSeries(r);
      else if (r.kind === "choice") renderChoice(recs);
      else if (r.kind === "softcap") renderSoftcap(r);
    }
  }
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d"];
  function renderSeries(r) {
    const i = state.pos;
    const text = r.labels.map((lab, c) => `${lab} ${r.values[i][c] === null ? "–" : r.values[i][c].toPrecision(3)}`).join(" · ");
    const t = $(r.dom + "-text");
    t.textContent = `${r.layer === null ? r.where : "layer " + r.layer}, token ${i} ${JSON.stringify(D.tokens[i].piece)}: ${text}`;
    t.dataset.pos = String(i);
    setChart(r.dom, r.dom + "-chart", {
      type: "line",
      data: { labels: D.tokens.map((_, k) => tokenLabel(k)), datasets: r.labels.map((lab, c) => ({
        label: lab, data: r.values.map((row) => row[c]), borderColor: PALETTE[c % PALETTE.length],
        backgroundColor: PALETTE[c % PALETTE.length], borderWidth: 1.5,
        pointRadius: (ctx) => (ctx.dataIndex === state.pos ? 5 : 0),
      })) },
      options: { maintainAspectRatio: false, plugins: { legend: { display: r.labels.length <= 16 } },
        scales: { x: { ticks: { autoSkip: true, maxRotation: 60 } } } },
    });
  }
  function renderChoice(recs) {
    const i = state.pos;
    const [option, count] = recs[0].labels;
    const k = recs[0].indices[0].length;
    const head = el("tr", {}, el("th", { text: "layer" }), ...Array.from({ length: k }, (_, s) => el("th", { text: `${option} #${s + 1}` })));
    const rows = recs.map((r) => el("tr", { "data-layer": String(r.layer) }, el("td", { text: r.layer === null ? r.where : "layer " + r.layer }),
      ...r.indices[i].map((e, s) => {
        const td = el("td", { class: "num", text: `${option} ${e} · ${r.weights[i][s].toFixed(3)}` });
        td.style.background = blue(r.weights[i][s] * 0.7);
        return td;
      })));
    const t = $(recs[0].dom + "-text");
    t.replaceChildren(el("p", { text: `Token ${i} ${JSON.stringify(D.tokens[i].piece)}: the ${k} ${option}s each layer picked, with their weights.` }),
      el("table", { "data-pos": String(i) }, el("thead", {}, head), el("tbody", {}, ...rows)));
    t.dataset.pos = String(i);
    // how often each option was picked over the whole prompt, per layer; the selected token's picks outlined
    const cells = [];
    recs.forEach((r, y) => {
      const uses = new Array(count).fill(0);
      r.indices.forEach((row) => row.forEach((e) => { uses[e] += 1; }));
      uses.forEach((u, x) => cells.push({ x, y, v: u / T, mine: r.indices[i].includes(x), layer: r.layer }));
    });
    setChart(recs[0].dom, recs[0].dom + "-chart", {
      type: "matrix",
      data: { datasets: [{ label: "share of tokens routed", data: cells,
        width: ({ chart }) => (chart.chartArea || {}).width / count, height: ({ chart }) => (chart.chartArea || {}).height / recs.length,
        backgroundColor: ({ raw }) => blue(raw ? Math.sqrt(raw.v) : 0),
        borderColor: ({ raw }) => (raw && raw.mine ? "#f59e0b" : "rgba(0,0,0,0.05)"), borderWidth: ({ raw }) => (raw && raw.mine ? 2 : 1) }] },
      options: { maintainAspectRatio: false, plugins: { legend: { display: false }, tooltip: { callbacks: {
          title: (items) => `layer ${items[0].raw.layer}, ${option} ${items[0].raw.x}`,
          label: (item) => `picked by ${(100 * item.raw.v).toFixed(1)}% of the tokens` + (item.raw.mine ? " (and by the selected one)" : "") } } },
        scales: { x: { type: "linear", min: -0.5, max: count - 0.5, offset: false, title: { display: true, text: option }, afterBuildTicks: integerTicks(count) },
          y: { type: "linear", min: -0.5, max: recs.length - 0.5, reverse: true, offset: false, afterBuildTicks: integerTicks(recs.length),
            ticks: { callback: (v) => (recs[v] ? "layer " + recs[v].layer : "") } } } },
    });
  }
  function renderSoftcap(r) {
    const i = state.pos;
    const cap = r.labels[0];
    const t = $(r.dom + "-text");
    const rows = r.ids[i].map((id, k) => el("tr", {}, el("td", { class: "cand", text: short(visible(pieceOf(id)), 24) }),
      el("td", { class: "num", text: r.before[i][k].toFixed(2) }), el("td", { class: "num", text: r.after[i][k].toFixed(2) })));
    t.replaceChildren(el("p", { text: `Token ${i} ${JSON.stringify(D.tokens[i].piece)}: its ${r.ids[i].length} largest logits, ` +
      `before and after cap · tanh(x / cap) with cap = ${cap}.` }),
      el("table", { "data-pos": String(i) }, el("thead", {}, el("tr", {}, el("th", { text: "token" }), el("th", { text: "before" }), el("th", { text: "after" }))),
        el("tbody", {}, ...rows)));
    t.dataset.pos = String(i);
    let reach = 1.5 * cap;
    for (const row of r.before) for (const v of row) if (v !== null) reach = Math.max(reach, Math.abs(v) * 1.1);
    const curve = Array.from({ length: 121 }, (_, k) => { const x = -reach + (2 * reach * k) / 120; return { x, y: cap * Math.tanh(x / cap) }; });
    setChart(r.dom, r.dom + "-chart", {
      type: "scatter",
      data: { datasets: [
        { label: `cap · tanh(x / cap), cap = ${cap}`, data: curve, showLine: true, pointRadius: 0, borderColor: "#9ca3af", borderWidth: 1.5 },
        { label: "x = y (no cap)", data: [{ x: -reach, y: -reach }, { x: reach, y: reach }], showLine: true, pointRadius: 0, borderColor: "#e5e7eb", borderDash: [4, 4] },
        { label: `the largest logits of token ${i}`, data: r.ids[i].map((id, k) => ({ x: r.before[i][k], y: r.after[i][k], id })),
          backgroundColor: "#2563eb", pointRadius: 4 },
      ] },
      options: { maintainAspectRatio: false, plugins: { tooltip: { callbacks: {
          label: (item) => (item.raw.id !== undefined ? `${JSON.stringify(pieceOf(item.raw.id))}: ${item.raw.x.toFixed(2)} → ${item.raw.y.toFixed(2)}` : "") } } },
        scales: { x: { title: { display: true, text: "logit before the cap" } }, y: { title: { display: true, text: "after" } } } },
    });
  }

  // ---------------------------------------------------------------- divergence
  function renderDivergence() {
    const box = $("divergence");
    const V = D.divergence;
    if (!V) {
      box.replaceChildren(el("p", { class: "note", text: "Not measured: run lollm trace with --compare (needs the parity extra, " +
        "pip install 'lollm-core[parity]') to compare every hidden state with transformers." }));
      $("divergence-chart").parentElement.hidden = true;
      return;
    }
    const verdict = V.first === null
      ? el("p", { class: "good", text: `Every hidden state matches ${V.reference}: cosine ≥ ${V.required} everywhere.` })
      : el("p", { class: "bad", text: `First divergence: ${V.rows[V.first]} (cosine ${V.cosine[V.first].toPrecision(8)} < ${V.required}).` });
    const rows = V.rows.map((label, r) => el("tr", { class: r === V.first ? "first" : "", "data-row": String(r) },
      el("td", { text: label }), el("td", { class: "num", text: V.cosine[r].toPrecision(10) }),
      el("td", { class: "num", text: V.max_abs[r].toExponential(2) })));
    box.replaceChildren(el("p", { class: "help", text: `Ours against ${V.reference} on the same ids: for every hidden state, the smallest cosine ` +
      "over the positions and the largest absolute difference of any number. A wrong layer shows as the first row below the parity gate's standard." }),
      verdict, el("table", { id: "divergence-table" }, el("thead", {}, el("tr", {}, el("th", { text: "state" }), el("th", { text: "min cosine" }),
        el("th", { text: "max |Δ|" }))), el("tbody", {}, ...rows)));
    const tiny = 1e-12;
    setChart("divergence", "divergence-chart", {
      type: "line",
      data: { labels: V.rows, datasets: [
        { label: "1 − cosine", data: V.cosine.map((c) => Math.max(1 - c, tiny)), borderColor: "#2563eb", backgroundColor: "#2563eb",
          pointRadius: V.rows.map((_, r) => (r === V.first ? 7 : 3)), pointBackgroundColor: V.rows.map((_, r) => (r === V.first ? "#dc2626" : "#2563eb")) },
        { label: "max |Δ|", data: V.max_abs.map((m) => Math.max(m, tiny)), borderColor: "#9333ea", backgroundColor: "#9333ea" },
        { label: `1 − ${V.required} (the gate)`, data: V.rows.map(() => 1 - V.required), borderColor: "#dc2626", borderDash: [5, 5], pointRadius: 0 },
      ] },
      options: { maintainAspectRatio: false, scales: { y: { type: "logarithmic", title: { display: true, text: "log scale" },
        ticks: { callback: (v) => { const e = Math.log10(v); return Math.abs(e - Math.round(e)) < 1e-9 ? "1e" + Math.round(e) : ""; } } } } },
    });
  }

  // ---------------------------------------------------------------- selection
  function pickLayer(layer) {
    if (attnByLayer.has(layer)) {
      state.layer = layer;
      $("attn-layer").value = String(layer);
      fillHeads();
      renderAttention();
    } else {
      state.layer = layer;
    }
    renderLens();
    renderInternals();
  }
  function select(i) {
    state.pos = i;
    document.querySelectorAll(".tok.selected").forEach((n) => n.classList.remove("selected"));
    document.querySelector(`.tok[data-pos="${i}"]`).classList.add("selected");
    const t = D.tokens[i];
    $("selected").textContent = `Selected: position ${i}, id ${t.id}, ${JSON.stringify(t.piece)}` +
      (i + 1 < T ? `; the next token in the prompt is ${JSON.stringify(D.tokens[i + 1].piece)}.` : "; the last token of the prompt.");
    document.body.dataset.pos = String(i);
    renderLens();
    renderAttention();
    renderInternals();
  }

  renderMeta();
  renderTokens();
  renderAttentionControls();
  renderInternalsOnce();
  renderDivergence();
  select(state.pos);
  document.body.dataset.ready = "true";
})().catch((err) => {
  console.error(err);
  document.body.prepend(Object.assign(document.createElement("pre"), { id: "error", textContent: "lollm trace: " + err }));
});
