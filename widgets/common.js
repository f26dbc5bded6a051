// What the live audit draws with: one number format, the viridis scale and its range, axis
// ticks, smoothing. The kernel's pictures are made by the same rules in Python
// (somatize/figures/_svg.py, _audit_face.py); tests/browser checks the two agree.

export const FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif";

export const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// `n` and the word, plural unless n is 1 (Python's `_svg.counted`): "1 place", "3 places".
export const counted = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

const trim = (text) => (text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text);

function sig(a) {
  return trim(a.toFixed(Math.max(0, 2 - Math.floor(Math.log10(a)))));
}

// three significant digits; k, M, G, T past a thousand; 1.2e-5 under a thousandth and 1.2e15
// from a thousand T
export function number(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "boolean") return v ? "true" : "false";
  if (typeof v !== "number") return String(v);
  if (Number.isNaN(v)) return "NaN";
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "−∞";
  if (v === 0) return "0";
  const a = Math.abs(v);
  const sign = v < 0 ? "−" : "";
  if (a < 1e-3 || a >= 0.9995e15) {
    const [m, e] = a.toExponential(2).split("e");
    return `${sign}${trim(m)}e${Number(e)}`;
  }
  for (const [size, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= size * 0.9995) return `${sign}${sig(a / size)}${suffix}`;
  }
  return sign + sig(a);
}

const VIRIDIS = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37],
];

export function viridis(t) {
  const x = Math.max(0, Math.min(1, Number.isFinite(t) ? t : 0)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const c = VIRIDIS[i].map((a, j) => Math.round(a + (VIRIDIS[i + 1][j] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// numbers to [0, 1]: linear, or logarithmic when all positive and spanning two decades
export function scaleOf(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (typeof v === "number" && Number.isFinite(v)) {
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
  }
  if (lo > hi) return { t: () => 0.5, lo: 0, hi: 0, log: false, empty: true };
  const log = lo > 0 && hi / lo > 100;
  const f = log ? Math.log10 : (v) => v;
  const a = f(lo);
  const b = f(hi);
  const t = (v) => (b === a ? 0.5 : log && v <= 0 ? 0 : Math.max(0, Math.min(1, (f(v) - a) / (b - a))));
  return { t, lo, hi, log, empty: false };
}

// round values for an axis from lo to hi (on a log axis, powers of ten; `whole`: integers)
export function ticks(lo, hi, most = 6, log = false, whole = false) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (log) {
    const a = Math.floor(Math.log10(lo));
    const b = Math.ceil(Math.log10(hi));
    const step = Math.max(1, Math.ceil((b - a + 1) / most));
    const out = [];
    for (let k = a; k <= b; k += step) if (10 ** k >= lo && 10 ** k <= hi) out.push(10 ** k);
    return out.length ? out : [lo, hi];
  }
  if (hi === lo) return [lo];
  const raw = (hi - lo) / Math.max(1, most - 1);
  const power = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
  if (whole) step = Math.max(1, Math.round(step));
  const first = Math.ceil(lo / step - 1e-9) * step;
  const out = [];
  for (let k = 0; first + k * step <= hi + step * 1e-9; k++) out.push(Number((first + k * step).toPrecision(12)));
  return out;
}

// an exponential moving average with its start debiased; NaN passed over
export function smoothed(values, weight) {
  const out = new Array(values.length);
  let acc = 0;
  let n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (Number.isFinite(v)) {
      acc = weight * acc + (1 - weight) * v;
      n += 1;
      out[i] = weight > 0 ? acc / (1 - weight ** n) : v;
    } else out[i] = NaN;
  }
  return out;
}

// ticks written one way (number), with more digits only where two would read alike
export function tickLabels(values) {
  let labels = values.map(number);
  for (let digits = 4; new Set(labels).size < labels.length && digits < 12; digits++) {
    labels = values.map((v) => {
      const t = v.toPrecision(digits);
      return t.includes("e") ? number(v) : t.includes(".") ? t.replace(/0+$/, "").replace(/\.$/, "") : t;
    });
  }
  return labels;
}
