// trainmon structure view: the module tree of a run with each node's figures at one step of one rank,
// the first NaN/Inf and its path (nan-analyze), and where the run parts from a baseline run (compare).
// Plain JS served by TensorBoard: nothing is fetched from the network. Children are built only when a node
// is first expanded, so a 100-layer model opens at once; ranks are chosen by number, so 1,000 ranks are too.

const state = {
  runs: [], run: null, rank: 0, step: null, baseline: "",
  tree: null, byId: new Map(), children: new Map(), nan: null, compare: null,
  userMoved: false, selected: null,
};

function el(tag, attrs = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const kid of kids) node.append(kid);
  return node;
}

async function getJson(route, params = {}) {
  const query = new URLSearchParams(params).toString();
  const response = await fetch(query ? `${route}?${query}` : route);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${route}: HTTP ${response.status}`);
  return body;
}

function setStatus(text, isError = false) {
  const status = document.getElementById("tm-status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

function figure(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(6);
  return String(value);
}

// ------------------------------------------------------------------------------------------- layout
function buildPage(root) {
  const runSelect = el("select", { id: "tm-run", title: "run" });
  const baseline = el("select", { id: "tm-baseline", title: "compare with this run" });
  const rank = el("input", { id: "tm-rank", type: "number", min: "0", step: "1", value: "0", title: "rank" });
  const stepSelect = el("select", { id: "tm-step", title: "step" });
  const search = el("input", { id: "tm-search", type: "search", placeholder: "search modules…" });
  const bar = el("div", { class: "tm-bar" },
    el("label", {}, "run ", runSelect), el("label", {}, "rank ", rank), el("span", { id: "tm-rank-range" }),
    el("label", {}, "step ", stepSelect), el("label", {}, "compare with ", baseline), search);
  const summary = el("div", { id: "tm-summary", class: "tm-summary" });
  const results = el("ul", { id: "tm-search-results", class: "tm-search-results" });
  const tree = el("div", { id: "tm-tree", class: "tm-tree" });
  const details = el("div", { id: "tm-details", class: "tm-details" });
  root.append(bar, el("div", { id: "tm-status", class: "tm-status" }), summary, results,
    el("div", { class: "tm-main" }, tree, details));

  // another run opens at its first NaN/Inf, as the first one did
  runSelect.addEventListener("change", () => { state.userMoved = false; selectRun(runSelect.value); });
  baseline.addEventListener("change", () => { state.baseline = baseline.value; loadCompare(); });
  rank.addEventListener("change", () => { state.userMoved = true; selectRank(Number(rank.value)); });
  stepSelect.addEventListener("change", () => { state.userMoved = true; selectStep(Number(stepSelect.value)); });
  search.addEventListener("input", () => runSearch(search.value));
  search.addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      const first = document.querySelector("#tm-search-results .tm-hit");
      if (first) reveal(first.dataset.node);
    }
  });
}

function fillSelect(select, values, chosen, labels = null) {
  select.replaceChildren(...values.map((value, i) =>
    el("option", { value: String(value), text: labels ? labels[i] : String(value) })));
  if (chosen !== null && chosen !== undefined) select.value = String(chosen);
}

// ------------------------------------------------------------------------------------------ loading
async function selectRun(run) {
  state.run = run;
  state.nan = null;
  state.compare = null;
  const info = state.runs.find((r) => r.run === run);
  const ranks = info ? info.ranks : [0];
  const rankInput = document.getElementById("tm-rank");
  rankInput.min = String(ranks[0]);
  rankInput.max = String(ranks[ranks.length - 1]);
  document.getElementById("tm-rank-range").textContent =
    `${ranks.length} rank${ranks.length === 1 ? "" : "s"}: ${ranks[0]}–${ranks[ranks.length - 1]}`;
  const others = state.runs.filter((r) => r.run !== run).map((r) => r.run);
  fillSelect(document.getElementById("tm-baseline"), [""].concat(others), state.baseline,
    ["(none)"].concat(others));
  if (!others.includes(state.baseline)) state.baseline = "";
  await selectRank(ranks.includes(state.rank) ? state.rank : ranks[0]);
  loadNan();
}

async function selectRank(rank) {
  const info = state.runs.find((r) => r.run === state.run);
  if (info && !info.ranks.includes(rank)) {
    setStatus(`rank ${rank} is not in this run`, true);
    return;
  }
  state.rank = rank;
  document.getElementById("tm-rank").value = String(rank);
  const { steps } = await getJson("steps", { run: state.run, rank });
  fillSelect(document.getElementById("tm-step"), steps, null);
  const step = steps.includes(state.step) ? state.step : steps[steps.length - 1];
  if (step === undefined) {
    setStatus(`rank ${rank} holds no records`);
    return;
  }
  await selectStep(step);
}

async function selectStep(step) {
  state.step = step;
  document.getElementById("tm-step").value = String(step);
  setStatus(`loading rank ${state.rank} step ${step}…`);
  state.tree = await getJson("tree", { run: state.run, rank: state.rank, step });
  indexTree();
  renderTree();
  setStatus(`${state.tree.nodes.length} nodes, rank ${state.rank}, step ${step}`);
  if (state.baseline) await loadCompare();
  runSearch(document.getElementById("tm-search").value);
  document.body.dataset.shown = `${state.run}:${state.rank}:${step}`;  // for scripts: what the tree shows
}

async function loadNan() {
  const run = state.run;
  try {
    const nan = await getJson("nan", { run });
    if (run !== state.run) return;
    state.nan = nan;
    const first = nan.first;
    if (first && !state.userMoved && (first.rank !== state.rank || first.step !== state.step)) {
      state.step = first.step;  // selectRank keeps it
      await selectRank(first.rank);
    }
    renderSummary();
    refreshClasses();
    if (first && first.rank === state.rank && first.step === state.step) reveal(first.node);
  } catch (err) {
    setStatus(`nan-analyze: ${err.message}`, true);
  }
  document.body.dataset.nanLoaded = "1";
}

async function loadCompare() {
  state.compare = null;
  if (state.baseline) {
    setStatus(`comparing with ${state.baseline}…`);
    try {
      state.compare = await getJson("compare",
        { run: state.run, baseline: state.baseline, rank: state.rank, step: state.step });
      setStatus(`compared with ${state.baseline}`);
    } catch (err) {
      setStatus(`compare: ${err.message}`, true);
    }
  }
  renderTree();
  renderSummary();
}

// --------------------------------------------------------------------------------------------- tree
function indexTree() {
  state.byId = new Map();
  state.children = new Map();
  for (const node of state.tree.nodes) {
    node.bad = node.nonfinite > 0;
    state.byId.set(node.id, node);
    if (node.parent !== null) {
      if (!state.children.has(node.parent)) state.children.set(node.parent, []);
      state.children.get(node.parent).push(node);
    }
  }
  // a node holding a non-finite record marks its ancestors (parents come before children in the list)
  for (const node of [...state.tree.nodes].reverse()) {
    if (node.bad && node.parent !== null) state.byId.get(node.parent).containsBad = true;
    if (node.containsBad && node.parent !== null) state.byId.get(node.parent).containsBad = true;
  }
}

function nodeClasses(node) {
  const classes = ["tm-node"];
  if (node.bad) classes.push("nonfinite");
  else if (node.containsBad) classes.push("contains-nonfinite");
  const cmp = state.compare && state.compare.nodes[node.id];
  if (cmp && cmp.diverged > 0) classes.push("diverged");
  if (state.compare && state.compare.first_divergent && state.compare.first_divergent.node === node.id) {
    classes.push("first-divergent");
  }
  // the first NaN/Inf and the places it reached, where they are: at the rank and step shown
  const here = (p) => p.rank === state.rank && p.step === state.step && p.node === node.id;
  const nan = state.nan && state.nan.first;
  if (nan && here(nan)) classes.push("first-nan");
  else if (nan && state.nan.chain.some(here)) classes.push("nan-path");
  if (node.id === state.selected) classes.push("selected");
  return classes.join(" ");
}

function nodeRow(node) {
  const kids = state.children.get(node.id) || [];
  const toggle = el("span", { class: "tm-toggle", text: kids.length ? "▸" : "·" });
  const badges = el("span", { class: "tm-badges" });
  if (node.nonfinite) badges.append(el("span", { class: "tm-badge bad", text: `${node.nonfinite} non-finite` }));
  const cmp = state.compare && state.compare.nodes[node.id];
  if (cmp) {
    badges.append(el("span", { class: "tm-badge cmp", text: `max rel ${figure(cmp.max_rel)}` }));
    if (cmp.cosine !== undefined) {
      badges.append(el("span", { class: "tm-badge cmp",
        text: `cos ${figure(cmp.cosine)} max err ${figure(cmp.max_abs)}` +
          (cmp.nonfinite_mismatch ? `, ${cmp.nonfinite_mismatch} NaN/Inf mismatches` : "") }));
    }
  }
  const row = el("div", { class: nodeClasses(node), "data-node": node.id },
    toggle, el("span", { class: "tm-label", text: node.label }),
    el("span", { class: "tm-class", text: node.class }), badges);
  const wrap = el("div", { class: "tm-item" }, row);
  toggle.addEventListener("click", (event) => { event.stopPropagation(); setExpanded(wrap, node, !wrap.expanded); });
  row.addEventListener("click", () => selectNode(node.id));
  wrap.node = node;
  return wrap;
}

function setExpanded(wrap, node, open) {
  const kids = state.children.get(node.id) || [];
  if (!kids.length) return;
  if (open && !wrap.childBox) {  // built on first expansion only
    wrap.childBox = el("div", { class: "tm-children" }, ...kids.map(nodeRow));
    wrap.append(wrap.childBox);
  }
  if (wrap.childBox) wrap.childBox.hidden = !open;
  wrap.expanded = open;
  wrap.firstChild.firstChild.textContent = open ? "▾" : "▸";
}

function renderTree() {
  const box = document.getElementById("tm-tree");
  if (!state.tree) return;
  const open = new Set([...box.querySelectorAll(".tm-item")].filter((w) => w.expanded).map((w) => w.node.id));
  const root = state.byId.get("");
  const top = nodeRow(root);
  box.replaceChildren(top);
  setExpanded(top, root, true);
  for (const id of [...open].sort((a, b) => a.length - b.length)) {
    const wrap = findItem(id);
    if (wrap) setExpanded(wrap, wrap.node, true);
  }
  refreshClasses();
  if (state.selected) selectNode(state.selected, false);
}

function findItem(id) {
  return [...document.querySelectorAll("#tm-tree .tm-item")].find((w) => w.node.id === id) || null;
}

function ancestors(id) {
  const chain = [];
  for (let node = state.byId.get(id); node; node = node.parent === null ? null : state.byId.get(node.parent)) {
    chain.unshift(node.id);
  }
  return chain;
}

// Expands the path to a node, selects it and scrolls it into view.
function reveal(id, select = true) {
  if (!state.byId.has(id)) return;
  const path = ancestors(id);
  for (const step of path.slice(0, -1)) {
    const wrap = findItem(step);
    if (wrap) setExpanded(wrap, wrap.node, true);
  }
  const wrap = findItem(id);
  if (!wrap) return;
  if (select) selectNode(id);
  wrap.firstChild.scrollIntoView({ block: "center" });
}

// The classes of the rows built so far, after the NaN report, a comparison or a selection changed.
function refreshClasses() {
  for (const wrap of document.querySelectorAll("#tm-tree .tm-item")) wrap.firstChild.className = nodeClasses(wrap.node);
}

// ------------------------------------------------------------------------------------------ details
function selectNode(id, scroll = true) {
  state.selected = id;
  refreshClasses();
  const wrap = findItem(id);
  const node = state.byId.get(id);
  const box = document.getElementById("tm-details");
  if (!node) return;
  const ops = state.tree.ops;
  const head = el("tr", {}, ...["family", "tensor", "micro"].concat(ops).map((h) => el("th", { text: h })));
  const rows = node.records.map((r) => el("tr", { class: recordBad(r) ? "nonfinite" : "" },
    el("td", { text: r.family }), el("td", { text: r.leaf }), el("td", { text: figure(r.micro_step) }),
    ...ops.map((op) => el("td", { text: figure(r[op]) }))));
  const title = el("h3", { id: "tm-selected", text: id === "" ? "(model)" : id });
  const parts = [title, el("div", { class: "tm-class", text: node.class })];
  const cmp = state.compare && state.compare.nodes[id];
  if (cmp) {
    parts.push(el("div", { class: "tm-cmp", text: `vs ${state.baseline}: max rel ${figure(cmp.max_rel)}, ` +
      `${cmp.diverged} diverged record(s)` + (cmp.cosine !== undefined ?
      `, cosine ${figure(cmp.cosine)}, max abs error ${figure(cmp.max_abs)}, ` +
      `${cmp.nonfinite_mismatch} NaN/Inf mismatches (dumped tensors)` : "") }));
  }
  parts.push(node.records.length ? el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows))
    : el("p", { text: "no records of this node at this step" }));
  box.replaceChildren(...parts);
  if (scroll && wrap) wrap.firstChild.scrollIntoView({ block: "nearest" });
}

function recordBad(record) {
  return (typeof record.nans === "number" && record.nans > 0) || (typeof record.infs === "number" && record.infs > 0);
}

function place(p) {
  const micro = p.micro_step === null || p.micro_step === undefined ? "" : ` micro-step ${p.micro_step}`;
  return `rank ${p.rank} step ${p.step}${micro}: ${p.module || "(model)"} ${p.phase} ${p.tensor}`;
}

function link(text, rank, step, node) {
  const a = el("a", { href: "#", class: "tm-link", text });
  a.addEventListener("click", async (event) => {
    event.preventDefault();
    state.userMoved = true;
    if (rank !== state.rank) await selectRank(rank);
    if (step !== state.step) await selectStep(step);
    reveal(node);
  });
  return a;
}

function renderSummary() {
  const box = document.getElementById("tm-summary");
  const parts = [];
  if (state.nan) {
    const first = state.nan.first;
    if (first) {
      parts.push(el("div", { id: "tm-first-nan", class: "tm-line bad" }, "first NaN/Inf: ",
        link(place(first), first.rank, first.step, first.node)));
      if (state.nan.chain.length) {
        const path = el("ol", { class: "tm-path" }, ...state.nan.chain.slice(0, 50).map((c) =>
          el("li", {}, link(place(c), c.rank, c.step, c.node))));
        const more = state.nan.chain.length > 50 ? ` (first 50 of ${state.nan.chain.length})` : "";
        parts.push(el("details", {}, el("summary", { text: `then reached${more}` }), path));
      }
    } else {
      parts.push(el("div", { class: "tm-line", text: "nan-analyze: no non-finite value in this run" }));
    }
  }
  if (state.compare) {
    const d = state.compare.first_divergent;
    parts.push(d ? el("div", { id: "tm-first-divergent", class: "tm-line diverged" },
      `first divergence from ${state.baseline}: `,
      link(`${d.family} ${d.name || "(model)"} step ${d.step}` + (d.micro_step === null ? "" :
        ` micro-step ${d.micro_step}`) + ` rank ${d.rank} (max rel ${figure(d.max_rel)})`, d.rank, d.step, d.node))
      : el("div", { class: "tm-line", text: `no divergence from ${state.baseline}` }));
  }
  box.replaceChildren(...parts);
}

// ------------------------------------------------------------------------------------------- search
function runSearch(text) {
  const box = document.getElementById("tm-search-results");
  const query = text.trim().toLowerCase();
  if (!query || !state.tree) {
    box.replaceChildren();
    return;
  }
  const hits = state.tree.nodes.filter((n) => n.id.toLowerCase().includes(query) ||
    n.class.toLowerCase().includes(query) || n.records.some((r) => r.leaf.toLowerCase().includes(query)));
  const shown = hits.slice(0, 100).map((n) => {
    const item = el("li", { class: "tm-hit", "data-node": n.id, text: n.id === "" ? "(model)" : n.id });
    item.addEventListener("click", () => reveal(n.id));
    return item;
  });
  const note = hits.length > 100 ? [el("li", { class: "tm-more", text: `… ${hits.length - 100} more` })] : [];
  box.replaceChildren(...(hits.length ? shown.concat(note) : [el("li", { class: "tm-more", text: "no match" })]));
}

// ------------------------------------------------------------------------------------------- entry
export async function render() {
  const style = el("link", { rel: "stylesheet", href: "style.css" });
  document.head.append(style);
  const root = el("div", { id: "tm-root", class: "tm-root" });
  document.body.append(root);
  buildPage(root);
  try {
    const { runs, open } = await getJson("runs");
    state.runs = runs;
    if (!runs.length) {
      setStatus("no trainmon run under the logdir, nor one that a trainmon watch view under it shows");
      return;
    }
    fillSelect(document.getElementById("tm-run"), runs.map((r) => r.run), open);
    await selectRun(open);
  } catch (err) {
    setStatus(err.message, true);
  }
  document.body.dataset.ready = "1";
}
