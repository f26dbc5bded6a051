// Shapes, colours and text helpers shared by the graph figure's drawing and its SVG export.
// Everything here is attribute-level (no CSS classes) so an exported SVG stands alone.

export const SVGNS = "http://www.w3.org/2000/svg";

export const THEMES = {
  light: {
    bg: "#ffffff",
    text: "#1f2430",
    muted: "#5d6575",
    box: "#f6f7fa",
    boxStroke: "#9aa3b5",
    inner: "#ffffff",
    group: "#7d8799",
    edge: "#7b8496",
    skip: "#0f9d8a",
    block: "#8a6fd1",
    blockFill: "rgba(138,111,209,0.06)",
  },
  dark: {
    bg: "#111620",
    text: "#e6e9ef",
    muted: "#9aa3b5",
    box: "#1b2130",
    boxStroke: "#4a5366",
    inner: "#161b27",
    group: "#6d7689",
    edge: "#8a93a6",
    skip: "#35c9b3",
    block: "#a98ef0",
    blockFill: "rgba(169,142,240,0.07)",
  },
};

// A family per kind of layer, each its own outline and hue. `kind` is a role from kind_of
// (learned, conv, recurrent, attention, norm, activation, regular, shaping, block, other);
// the label (a class or function name) refines it: an Embedding among the learned, a pool
// among the shaping, an add among the others.
const HUES = {
  conv: "#1a9c8c",
  attention: "#8d5bd6",
  linear: "#3d6fd9",
  embedding: "#c2457a",
  norm: "#8a8f99",
  activation: "#2f9e44",
  pool: "#d08a16",
  dropout: "#9a9a9a",
  recurrent: "#d2691e",
  reshape: "#6b7a90",
  op: "#5f6b7d",
  block: "#8a6fd1",
  other: "#6c7a96",
};

// The kind says what a layer computes with (GPT-2's Conv1D is learned: a linear layer); the
// label only refines a kind (an embedding, a pool), or stands in where no kind says.
const BY_KIND = { conv: "conv", attention: "attention", recurrent: "recurrent", norm: "norm", activation: "activation", regular: "dropout", embedding: "embedding", pool: "pool", op: "op", block: "block" };

function familyName(kind, label) {
  const k = String(kind || "").toLowerCase();
  const l = String(label || "");
  if (k in BY_KIND) return BY_KIND[k];
  if (k === "learned" || k === "linear") return /embed/i.test(l) ? "embedding" : "linear";
  if (k === "shaping") return /pool/i.test(l) ? "pool" : "reshape";
  if (k === "conv" || /conv/i.test(l)) return "conv";
  if (k === "attention" || /attn|attention/i.test(l)) return "attention";
  if (k === "recurrent" || /lstm|gru|rnn/i.test(l)) return "recurrent";
  if (k === "norm" || /norm/i.test(l)) return "norm";
  if (k === "activation") return "activation";
  if (k === "regular" || /dropout|droppath/i.test(l)) return "dropout";
  if (/embed/i.test(l) || k === "embedding") return "embedding";
  if (k === "learned" || k === "linear" || /linear|dense/i.test(l)) return "linear";
  if (/pool/i.test(l) || k === "pool") return "pool";
  if (k === "shaping") return "reshape";
  if (/^(add|sub|mul|truediv|div|matmul|cat|concat|stack|sum|\+|×|getitem)\b/i.test(l) || k === "op") return "op";
  if (/relu|gelu|tanh|sigmoid|silu|swish|softmax|elu|mish|softplus/i.test(l)) return "activation";
  if (k === "block") return "block";
  return "other";
}

export function family(kind, label) {
  const name = familyName(kind, label);
  return { name, hue: HUES[name] };
}

// The outline of a layer box of this family, w x h at (0, 0).
export function outline(fam, w, h) {
  const s = Math.min(12, w / 6);
  const m = h / 2;
  switch (fam) {
    case "conv": // parallelogram
      return `M${s},0 H${w} L${w - s},${h} H0 Z`;
    case "linear": // trapezoid, wide at the bottom
      return `M${s},0 H${w - s} L${w},${h} H0 Z`;
    case "pool": // trapezoid, wide at the top
      return `M0,0 H${w} L${w - s},${h} H${s} Z`;
    case "activation": // pointed at both ends
      return `M0,${m} L${s},0 H${w - s} L${w},${m} L${w - s},${h} H${s} Z`;
    case "norm": // bevelled corners
      return `M${s / 2},0 H${w - s / 2} L${w},${s / 2} V${h - s / 2} L${w - s / 2},${h} H${s / 2} L0,${h - s / 2} V${s / 2} Z`;
    case "attention": // capsule
      return `M${m},0 H${w - m} A${m},${m} 0 0 1 ${w - m},${h} H${m} A${m},${m} 0 0 1 ${m},0 Z`;
    case "embedding": // barrel
      return `M${s},0 H${w - s} Q${w},${m} ${w - s},${h} H${s} Q0,${m} ${s},0 Z`;
    case "op": {
      const r = Math.min(6, h / 2);
      return `M${r},0 H${w - r} Q${w},0 ${w},${r} V${h - r} Q${w},${h} ${w - r},${h} H${r} Q0,${h} 0,${h - r} V${r} Q0,0 ${r},0 Z`;
    }
    default:
      return `M0,0 H${w} V${h} H0 Z`;
  }
}

let ctx = null;
export const FONT = "12px system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif";
export const FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif";

export function textWidth(text, px = 12, weight = "normal") {
  if (!ctx) {
    try {
      ctx = document.createElement("canvas").getContext("2d");
    } catch (_) {
      ctx = null;
    }
  }
  if (!ctx) return String(text).length * px * 0.6;
  ctx.font = `${weight} ${px}px ${FONT_FAMILY}`;
  return ctx.measureText(String(text)).width;
}

export function el(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  if (parent) parent.appendChild(node);
  return node;
}

// Output shapes named by axis, as the picture of a network reads them.
export function shapeText(shape, kind) {
  if (!Array.isArray(shape) || shape.length === 0) return "";
  const n = shape.length;
  const spatial = /conv|pool|norm2d|norm1d|batchnorm|upsample/i.test(String(kind || ""));
  let names;
  if (n === 1) names = ["dim"];
  else if (n === 2) names = ["batch", "dim"];
  else if (n === 3) names = spatial ? ["batch", "ch", "len"] : ["batch", "len", "dim"];
  else if (n === 4) names = /attention/i.test(String(kind || "")) ? ["batch", "heads", "seq", "dim"] : ["batch", "ch", "h", "w"];
  else if (n === 5) names = ["batch", "ch", "d", "h", "w"];
  else names = shape.map((_, i) => (i === 0 ? "batch" : `d${i}`));
  return shape.map((v, i) => `${v} ${names[i]}`).join(" · ");
}

export function count(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const a = Math.abs(n);
  if (a >= 1e9) return `${(n / 1e9).toFixed(a >= 1e10 ? 0 : 1)}G`;
  if (a >= 1e6) return `${(n / 1e6).toFixed(a >= 1e7 ? 0 : 1)}M`;
  if (a >= 1e3) return `${(n / 1e3).toFixed(a >= 1e4 ? 0 : 1)}k`;
  return String(n);
}

export function number(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

// A perceptual sequential scale (viridis, sampled) from 0 to 1.
const VIRIDIS = [
  [68, 1, 84],
  [72, 40, 120],
  [62, 74, 137],
  [49, 104, 142],
  [38, 130, 142],
  [31, 158, 137],
  [53, 183, 121],
  [109, 205, 89],
  [180, 222, 44],
  [253, 231, 37],
];

export function viridis(t) {
  const x = Math.max(0, Math.min(1, Number.isFinite(t) ? t : 0)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const c = VIRIDIS[i].map((a, j) => Math.round(a + (VIRIDIS[i + 1][j] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Readable text on a viridis fill: dark on the bright end, light on the dark end.
export function inkOn(t) {
  return t > 0.55 ? "#111" : "#fff";
}

// A scale over some numbers: linear, or logarithmic when they are all positive and span decades.
export function scaleOf(values) {
  const xs = values.filter((v) => typeof v === "number" && Number.isFinite(v));
  if (xs.length === 0) return { t: () => 0.5, lo: 0, hi: 0, log: false };
  let lo = Math.min(...xs);
  let hi = Math.max(...xs);
  const log = lo > 0 && hi / lo > 100;
  const f = log ? Math.log10 : (v) => v;
  const a = f(lo);
  const b = f(hi);
  const t = (v) => (b === a ? 0.5 : (f(v) - a) / (b - a));
  return { t, lo, hi, log };
}
