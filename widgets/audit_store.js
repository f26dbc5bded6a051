// What the live audit's page holds: every run's loss, and per place its steps, a column per
// metric and the flags of its rows, as the kernel sends them (binary float64 arrays beside a
// JSON message) or kept them for a page with no kernel (the `record` trait, JSON).

const stores = new WeakMap();

export function storeOf(model) {
  let s = stores.get(model);
  if (!s) {
    s = { runs: new Map(), metrics: [], kinds: {}, seq: 0, live: false, listeners: new Set() };
    stores.set(model, s);
  }
  return s;
}

function runOf(s, name) {
  if (!s.runs.has(name)) s.runs.set(name, { lossSteps: [], lossValues: [], places: new Map() });
  return s.runs.get(name);
}

function bytesOf(b) {
  if (b instanceof ArrayBuffer) return b;
  return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); // a view, maybe unaligned
}

// a column as the kernel sends it: a float64 buffer ({buffer: i}) or JSON ({values}), with
// the rows that lacked the metric in `absent`
function valuesOf(c, buffers) {
  let out;
  if (c.values) out = c.values.map((v) => (v === "nan" ? NaN : v === "inf" ? Infinity : v === "-inf" ? -Infinity : v));
  else out = Array.from(new Float64Array(bytesOf(buffers[c.buffer])));
  for (const i of c.absent || []) out[i] = null;
  return out;
}

function take(s, msg, buffers) {
  if (msg.kind === "reset") {
    s.runs = new Map();
    s.binnedFrom = 0;
  }
  for (const m of msg.metrics || []) if (!s.metrics.includes(m)) s.metrics.push(m);
  Object.assign(s.kinds, msg.kinds || {});
  for (const entry of msg.runs || []) {
    const run = runOf(s, entry.run);
    if (entry.loss) {
      const v = entry.loss.values;
      const values = Array.isArray(v) ? valuesOf({ values: v }, buffers) : valuesOf(v, buffers);
      for (const x of entry.loss.steps) run.lossSteps.push(x);
      for (const x of values) run.lossValues.push(x === null ? NaN : x);
    }
    for (const p of entry.places || []) {
      let place = run.places.get(p.where);
      if (!place) {
        place = { steps: [], cols: new Map(), flags: new Map() };
        run.places.set(p.where, place);
      }
      if (p.from !== place.steps.length) return false; // something was missed
      if (p.of) s.binnedFrom = Math.max(s.binnedFrom || 0, p.of); // a record: one row a bin
      const n = p.steps.length;
      const rows = place.steps.length;
      for (const [metric, c] of Object.entries(p.columns || {})) {
        if (!place.cols.has(metric)) place.cols.set(metric, new Array(rows).fill(null));
        const col = place.cols.get(metric);
        for (const v of valuesOf(c, buffers)) col.push(v);
      }
      for (const col of place.cols.values()) while (col.length < rows + n) col.push(null);
      for (const st of p.steps) place.steps.push(st);
    }
    for (const f of entry.flags || []) {
      const place = run.places.get(f.where);
      if (place) for (const [row, flags] of f.rows) place.flags.set(row, flags);
    }
  }
  return true;
}

function receive(model, msg, buffers) {
  if (!msg || typeof msg !== "object" || (msg.kind !== "reset" && msg.kind !== "append")) return;
  const s = storeOf(model);
  if (msg.kind === "append" && s.seq && msg.seq !== s.seq + 1) {
    model.send({ kind: "hello" }); // a message was missed: ask for everything again
  }
  if (!take(s, msg, buffers)) model.send({ kind: "hello" });
  s.seq = msg.seq ?? s.seq + 1;
  s.live = true;
  for (const f of s.listeners) f();
}

// what the kernel kept for a page with no kernel to talk to (a saved notebook, a saved page)
function fromRecord(model) {
  const s = storeOf(model);
  const r = model.get("record");
  if (s.live || !r || !r.kind) return;
  take(s, r, []);
  for (const f of s.listeners) f();
}

export function initialize({ model }) {
  const s = storeOf(model);
  const onMsg = (msg, buffers) => receive(model, msg, buffers);
  const onRecord = () => fromRecord(model);
  model.on("msg:custom", onMsg);
  model.on("change:record", onRecord);
  s.started = true;
  fromRecord(model);
  model.send({ kind: "hello" }); // a page opened late asks for what it missed
  return () => {
    model.off("msg:custom", onMsg);
    model.off("change:record", onRecord);
  };
}
