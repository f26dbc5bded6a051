// From the figure's data (a graph's plan, the insides of its nodes, what is open and expanded)
// to an ELK graph to lay out, and a map from every ELK id to what it stands for.

import { family, shapeText, textWidth } from "./shapes.js";

const TITLE_H = 40;
const LAYER_H = 38;
const LAYER_H_BARE = 26;

function pillsOf(node) {
  const out = [];
  if (node.device) out.push({ text: String(node.device), kind: "device" });
  if (node.host) out.push({ text: `@${node.host}`, kind: "host" });
  if (node.cached) out.push({ text: "cached", kind: "cached" });
  if (node.frozen) out.push({ text: "frozen", kind: "frozen" });
  if (node.mapped) out.push({ text: "mapped", kind: "mapped" });
  return out;
}

function pillsWidth(pills) {
  return pills.reduce((a, p) => a + textWidth(p.text, 10) + 12 + 4, 0);
}

// Branches that leave one node and meet again at one node, grouped (the nodes strictly between).
export function branchGroups(nodes, edges) {
  const succ = new Map(nodes.map((n) => [n, []]));
  const pred = new Map(nodes.map((n) => [n, []]));
  for (const [a, b] of edges) {
    if (succ.has(a) && pred.has(b)) {
      succ.get(a).push(b);
      pred.get(b).push(a);
    }
  }
  const reach = (start, next) => {
    const seen = new Set();
    const stack = [...start];
    while (stack.length) {
      const x = stack.pop();
      if (seen.has(x)) continue;
      seen.add(x);
      for (const y of next.get(x)) stack.push(y);
    }
    return seen;
  };
  const order = nodes;
  const groups = [];
  const taken = new Set();
  for (const f of order) {
    const outs = succ.get(f);
    if (outs.length < 2) continue;
    const below = outs.map((s) => reach([s], succ));
    // the join: the first node (in order) every branch reaches
    const join = order.find((n) => below.every((set) => set.has(n)));
    if (join === undefined) continue;
    const down = reach(outs, succ);
    const members = new Set();
    for (const n of down) {
      if (n === join) continue;
      if (!reach([n], succ).has(join)) continue;
      members.add(n);
    }
    if (members.size < 2) continue;
    // closed: members talk only to f, each other and the join
    let closed = true;
    for (const n of members) {
      for (const p of pred.get(n)) if (p !== f && !members.has(p)) closed = false;
      for (const s of succ.get(n)) if (s !== join && !members.has(s)) closed = false;
    }
    if (!closed) continue;
    if ([...members].some((n) => taken.has(n))) continue;
    for (const n of members) taken.add(n);
    groups.push({ from: f, to: join, branches: outs.length, members: order.filter((n) => members.has(n)) });
  }
  return groups;
}

// A layer's label, with ×N when it is folded on its own (not as part of a folded block).
function layerText(layer, blocks) {
  const text = layer.label ?? layer.kind ?? layer.path;
  const times = layer.times ?? 1;
  const outer = blocks && layer.block && blocks.has(layer.block) ? blocks.get(layer.block).times : 1;
  return times > 1 && times > outer ? `${text}  ×${times}` : text;
}

function layerBox(layer, blocks) {
  const text = layerText(layer, blocks);
  let inAttention = false; // inside attention a 4-D tensor is heads · seq, not an image
  for (let b = layer.block; blocks && b && blocks.has(b); b = blocks.get(b).parent) {
    if (blocks.get(b).kind === "attention") inAttention = true;
  }
  const sub = shapeText(layer.shape, inAttention ? "attention" : layer.kind);
  const w = Math.max(textWidth(text, 12, "600"), sub ? textWidth(sub, 11) : 0) + 36;
  return { width: Math.max(64, Math.ceil(w)), height: sub ? LAYER_H : LAYER_H_BARE, sub };
}

// The blocks of an inside: {path: {path, kind, label, times, repeats, parent}}.
function blocksOf(layers) {
  const byPath = new Map(layers.map((l) => [l.path, l]));
  const paths = new Set(layers.map((l) => l.block).filter((b) => b !== null && b !== undefined));
  const blocks = new Map();
  for (const b of paths) {
    const own = byPath.get(b);
    const times = Math.max(1, own?.times ?? 1);
    const withRepeats = own && Array.isArray(own.repeats) && own.repeats.length ? own : null;
    const last = String(b).split(".").pop();
    blocks.set(b, {
      path: b,
      kind: own?.kind ?? null,
      label: own?.label ?? own?.kind ?? last,
      times,
      repeats: withRepeats ? withRepeats.repeats.filter((r) => r !== b) : [],
      parent: own?.block ?? null,
    });
  }
  // a block whose entry does not say its parent: the longest enclosing block path
  for (const blk of blocks.values()) {
    if (blk.parent && blocks.has(blk.parent)) continue;
    blk.parent = null;
    for (const other of blocks.keys()) {
      if (other !== blk.path && String(blk.path).startsWith(`${other}.`)) {
        if (!blk.parent || other.length > blk.parent.length) blk.parent = other;
      }
    }
  }
  return blocks;
}

function swapPrefix(path, from, to) {
  if (path === from) return to;
  if (String(path).startsWith(`${from}.`)) return to + String(path).slice(from.length);
  return path;
}

// Lay out one node's inside into `container.children`, edges into `edgesOut`.
function insideScene(nodeId, inside, expanded, meta, container, edgesOut) {
  const layers = (inside.layers || []).map((l) => ({ ...l, path: String(l.path) }));
  const blocks = blocksOf(layers);
  const drawn = layers.filter((l) => !blocks.has(l.path));
  let edges = (inside.edges || []).map(([a, b]) => [String(a), String(b)]);
  if (edges.length === 0 && drawn.length > 1) {
    const chain = drawn.filter((l) => !l.block);
    edges = chain.slice(1).map((l, i) => [chain[i].path, l.path]);
  }
  const lid = (path) => `l:${nodeId}:${path}`;
  const bid = (path, k) => `b:${nodeId}:${path}#${k}`;

  // blocks that are expanded, and the copies they make
  const isOpen = (b) => expanded.includes(`${nodeId}:${b}`);
  const byBlock = (b) => layers.filter((l) => l.block === b && !blocks.has(l.path));

  // the ancestors chain of a block, outermost first
  const chainOf = (b) => {
    const out = [];
    let x = b;
    while (x) {
      out.unshift(x);
      x = blocks.get(x)?.parent ?? null;
    }
    return out;
  };

  const copies = []; // {block, made: [{from, to, elk, k}]}

  function emitBlock(b, parentElk, prefixFrom, prefixTo) {
    const blk = blocks.get(b);
    const kids = [...blocks.values()].filter((x) => x.parent === b);
    const plain = /^(Sequential|ModuleList|ModuleDict)$/.test(String(blk.label));
    if (blk.times === 1 && (plain || (byBlock(b).length === 0 && kids.length === 1))) {
      // a plain container draws as what it holds
      for (const l of byBlock(b)) emitLayer(l, parentElk, prefixFrom, prefixTo);
      for (const k of kids) emitBlock(k.path, parentElk, prefixFrom, prefixTo);
      return;
    }
    const open = blk.times > 1 && isOpen(b);
    const n = open ? blk.times : 1;
    const names = [b, ...blk.repeats];
    const made = [];
    for (let k = 0; k < n; k++) {
      const realPath = swapPrefix(b, prefixFrom, prefixTo);
      const copyPath = k === 0 ? realPath : swapPrefix(names[k] ?? `${b}~${k}`, prefixFrom, prefixTo);
      const head = blk.times > 1 ? `${blk.label}  ×${blk.times}` : blk.label;
      const label = open ? `${blk.label}  ${k + 1}/${blk.times}` : head;
      const id = bid(copyPath, k);
      const elk = {
        id,
        children: [],
        layoutOptions: { "elk.padding": "[top=24,left=10,bottom=10,right=10]" },
        width: textWidth(label, 11, "600") + 40,
        height: 30,
      };
      meta.set(id, {
        type: "block",
        node: nodeId,
        path: b,
        label,
        times: blk.times,
        open,
        copy: k,
        foldable: blk.times > 1,
        kind: blk.kind,
      });
      parentElk.children.push(elk);
      // the copy's layers: swap the block's path for the copy's
      const from = k === 0 ? prefixFrom : b;
      const to = k === 0 ? prefixTo : copyPath;
      for (const l of byBlock(b)) emitLayer(l, elk, from, to);
      for (const inner of blocks.values()) if (inner.parent === b) emitBlock(inner.path, elk, from, to);
      made.push({ from, to, elk, k });
    }
    copies.push({ block: b, made, prefixFrom, prefixTo });
  }

  function emitLayer(l, parentElk, from, to) {
    const path = swapPrefix(l.path, from, to);
    const box = layerBox(l, blocks);
    const id = lid(path);
    parentElk.children.push({ id, width: box.width, height: box.height });
    meta.set(id, {
      type: "layer",
      node: nodeId,
      path,
      label: layerText(l, blocks),
      kind: l.kind,
      shape: l.shape,
      params: l.params,
      sub: box.sub,
      family: family(l.kind, l.label).name,
      times: l.times ?? 1,
      copyOf: path === l.path ? null : l.path,
    });
  }

  for (const l of drawn) if (!l.block || !blocks.has(l.block)) emitLayer(l, container, "", "");
  for (const blk of blocks.values()) if (!blk.parent) emitBlock(blk.path, container, "", "");

  // edges: originals, and for expanded blocks the copies chained one after the other
  const members = (b) =>
    layers.filter((l) => l.path === b || String(l.path).startsWith(`${b}.`) || chainOf(l.block).includes(b)).map((l) => l.path);
  const openCopies = copies.filter((c) => c.made.length > 1);
  const rewritten = [];
  for (const [a, b] of edges) rewritten.push([a, b]);
  let out = rewritten;
  for (const c of openCopies) {
    const inB = new Set(members(c.block));
    const next = [];
    const n = c.made.length;
    for (const [a, b] of out) {
      const ai = inB.has(a);
      const bi = inB.has(b);
      if (ai && bi) {
        for (const m of c.made) next.push([swapPrefix(a, m.from, m.to), swapPrefix(b, m.from, m.to)]);
      } else if (!ai && bi) {
        next.push([a, b]);
        // into later copies from the exit of the copy before
        const exits = out.filter(([x, y]) => inB.has(x) && !inB.has(y)).map(([x]) => x);
        for (let k = 1; k < n; k++) {
          for (const x of exits.length ? exits : [a]) {
            next.push([swapPrefix(x, c.made[k - 1].from, c.made[k - 1].to), swapPrefix(b, c.made[k].from, c.made[k].to)]);
          }
        }
      } else if (ai && !bi) {
        next.push([swapPrefix(a, c.made[n - 1].from, c.made[n - 1].to), b]);
      } else {
        next.push([a, b]);
      }
    }
    out = next;
  }
  const known = (p) => meta.has(lid(p));
  const seen = new Set();
  for (const [a, b] of out) {
    const s = known(a) ? lid(a) : blocks.has(a) ? bid(a, 0) : null;
    const t = known(b) ? lid(b) : blocks.has(b) ? bid(b, 0) : null;
    if (!s || !t || s === t) continue;
    const key = `${s}>${t}`;
    if (seen.has(key)) continue;
    seen.add(key);
    edgesOut.push({ id: `e:${nodeId}:${edgesOut.length}:${key}`, sources: [s], targets: [t] });
  }
}

// Parameters of everything an inside holds, a folded block counted as often as it repeats
// (each once when the inside says how many it holds: a tied weight is one weight).
export function totalParams(inside) {
  if (Number.isFinite(inside.params) && inside.params > 0) return inside.params;
  const layers = (inside.layers || []).map((l) => ({ ...l, path: String(l.path) }));
  const blocks = blocksOf(layers);
  let total = 0;
  for (const l of layers) {
    if (blocks.has(l.path)) continue;
    let times = 1;
    let b = l.block;
    while (b && blocks.has(b)) {
      times *= blocks.get(b).times;
      b = blocks.get(b).parent;
    }
    total += (l.params || 0) * Math.max(times, l.times ?? 1);
  }
  return total;
}

const BASE = {
  "elk.algorithm": "layered",
  "elk.hierarchyHandling": "INCLUDE_CHILDREN",
  "elk.json.shapeCoords": "ROOT",
  "elk.json.edgeCoords": "ROOT",
  "elk.edgeRouting": "ORTHOGONAL",
  "elk.layered.nodePlacement.strategy": "BRANDES_KOEPF",
  "elk.layered.considerModelOrder.strategy": "NODES_AND_EDGES",
};

export const INSIDE_PAD = { left: 12, right: 12, bottom: 12 };

// The scene: a top-level ELK graph of nodes (left to right) and, for every open node, its own
// ELK graph of layers (top to bottom), laid out first so the node's box can hold it.
export function buildScene(plan, insides, opened, expanded, options = {}) {
  const meta = new Map();
  const nodes = (plan && plan.nodes) || [];
  const order = nodes.map((n) => String(n.id));
  const byId = new Map(nodes.map((n) => [String(n.id), n]));
  const edges = ((plan && plan.edges) || []).map(([a, b]) => [String(a), String(b)]);
  const root = {
    id: "root",
    layoutOptions: {
      ...BASE,
      "elk.direction": "RIGHT",
      "elk.layered.spacing.nodeNodeBetweenLayers": "40",
      "elk.spacing.nodeNode": "20",
      "elk.layered.spacing.edgeNodeBetweenLayers": "14",
      "elk.spacing.edgeNode": "12",
      "elk.padding": "[top=12,left=12,bottom=12,right=12]",
    },
    children: [],
    edges: [],
  };
  if (options.wrap ?? nodes.length > 16) {
    root.layoutOptions["elk.layered.wrapping.strategy"] = "MULTI_EDGE";
    root.layoutOptions["elk.aspectRatio"] = String(options.aspect ?? 1.6);
    root.layoutOptions["elk.layered.wrapping.additionalEdgeSpacing"] = "12";
  }

  const groups = branchGroups(order, edges);
  const groupOf = new Map();
  groups.forEach((g, i) => {
    const id = `g:${i}`;
    const elk = { id, children: [], layoutOptions: { "elk.padding": "[top=22,left=10,bottom=10,right=10]" } };
    meta.set(id, { type: "group", from: g.from, to: g.to, members: g.members, label: `${g.branches} branches` });
    root.children.push(elk);
    for (const m of g.members) groupOf.set(m, elk);
  });

  const subs = new Map();
  for (const id of order) {
    const n = byId.get(id);
    const inside = insides ? insides[id] : null;
    const open = !!inside && (opened || []).includes(id);
    const pills = pillsOf(n);
    const params = inside ? totalParams(inside) : null;
    const title = textWidth(id, 13, "700");
    const sub = `${n.kind ?? ""}${params ? ` · ${paramsText(params)}` : ""}${inside && !open ? "  ▸" : ""}`;
    const w = Math.ceil(Math.max(title, textWidth(sub, 11), pillsWidth(pills)) + 28);
    const h = pills.length ? 62 : 46;
    const elkNode = { id: `n:${id}`, width: Math.max(90, w), height: h };
    const top = TITLE_H + (pills.length ? 18 : 0);
    meta.set(elkNode.id, { type: "node", id, node: n, open, hasInside: !!inside, pills, sub, params, top });
    if (open) {
      const inner = {
        id: `s:${id}`,
        layoutOptions: {
          ...BASE,
          "elk.direction": "DOWN",
          "elk.layered.spacing.nodeNodeBetweenLayers": "22",
          "elk.spacing.nodeNode": "16",
          "elk.spacing.edgeNode": "10",
          "elk.padding": "[top=0,left=0,bottom=0,right=0]",
        },
        children: [],
        edges: [],
      };
      insideScene(id, inside, expanded || [], meta, inner, inner.edges);
      subs.set(id, inner);
    }
    (groupOf.get(id) || root).children.push(elkNode);
  }
  edges.forEach(([a, b], i) => {
    if (!byId.has(a) || !byId.has(b)) return;
    root.edges.push({ id: `e:top:${i}`, sources: [`n:${a}`], targets: [`n:${b}`] });
    meta.set(`e:top:${i}`, { type: "edge", from: a, to: b });
  });
  return { elk: root, meta, subs };
}

function shiftAll(node, dx, dy) {
  const move = (n) => {
    for (const c of n.children || []) {
      c.x += dx;
      c.y += dy;
      move(c);
    }
    for (const e of n.edges || []) {
      for (const s of e.sections || []) {
        for (const p of [s.startPoint, s.endPoint, ...(s.bendPoints || [])]) {
          p.x += dx;
          p.y += dy;
        }
      }
    }
  };
  move(node);
}

// Lay the scene out with `elk` (an ELK instance): insides first, then the nodes around them.
export async function layoutScene(elk, scene) {
  const laidSubs = new Map();
  await Promise.all(
    [...scene.subs.entries()].map(async ([id, g]) => {
      laidSubs.set(id, await elk.layout(g));
    }),
  );
  const find = (node, id) => {
    for (const c of node.children || []) {
      if (c.id === id) return c;
      const r = find(c, id);
      if (r) return r;
    }
    return null;
  };
  for (const [id, sub] of laidSubs) {
    const box = find(scene.elk, `n:${id}`);
    const m = scene.meta.get(box.id);
    box.width = Math.max(box.width, Math.ceil(sub.width) + INSIDE_PAD.left + INSIDE_PAD.right);
    box.height = Math.ceil(sub.height) + m.top + INSIDE_PAD.bottom;
  }
  const laid = await elk.layout(scene.elk);
  for (const [id, sub] of laidSubs) {
    const box = find(laid, `n:${id}`);
    const m = scene.meta.get(box.id);
    const dx = box.x + (box.width - sub.width) / 2;
    const dy = box.y + m.top;
    shiftAll(sub, dx, dy);
    box.children = sub.children;
    box.edges = sub.edges;
  }
  return laid;
}

export function paramsText(n) {
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M params`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)}k params`;
  return `${n} params`;
}
