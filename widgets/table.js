// The comparison table's browser half: it shows the table the kernel drew (the `drawing`
// trait: the table, its scatter and its legend) and makes it respond without the kernel: a
// header click sorts the rows, a toggle shows a hidden group of columns, the menu picks the
// score the scatter shows. Each also sets its trait, so the kernel's copy follows.

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "smz-table";
  host.appendChild(root);

  const sortRows = (col, ascending) => {
    const body = root.querySelector("tbody");
    if (!body) return;
    const rows = [...body.querySelectorAll("tr")];
    const indexName = (model.get("table") || {}).index_name || "candidate";
    const key = (tr) => {
      if (col === indexName) return tr.dataset.row;
      const td = tr.querySelector(`td[data-col="${CSS.escape(col)}"]`);
      return td && td.dataset.v !== undefined ? Number(td.dataset.v) : null;
    };
    rows.sort((a, b) => {
      const x = key(a);
      const y = key(b);
      if (x === null && y === null) return 0;
      if (x === null) return 1;
      if (y === null) return -1;
      const d = typeof x === "string" ? x.localeCompare(y) : x - y;
      return ascending ? d : -d;
    });
    body.replaceChildren(...rows);
    for (const th of root.querySelectorAll("thead th[data-col]")) {
      th.textContent = th.textContent.replace(/ [▲▼]$/, "") + (th.dataset.col === col ? (ascending ? " ▲" : " ▼") : "");
    }
  };

  const showGroup = (group) => {
    for (const cell of root.querySelectorAll(`[data-col][data-group="${CSS.escape(group)}"], td[data-col]`)) {
      const th = root.querySelector(`thead th[data-col="${CSS.escape(cell.dataset.col)}"]`);
      if (th && th.dataset.group === group) cell.style.display = "";
    }
    const head = root.querySelector(`thead th.smz-group[data-group="${CSS.escape(group)}"]`);
    if (head) {
      head.style.display = "";
      head.colSpan = root.querySelectorAll(`thead th[data-col][data-group="${CSS.escape(group)}"]`).length;
    }
    const button = root.querySelector(`.smz-toggle[data-group="${CSS.escape(group)}"]`);
    if (button) button.remove();
  };

  function show() {
    root.innerHTML = model.get("drawing") || "";
    root.dataset.drawn = String(Number(root.dataset.drawn || 0) + 1);
  }

  root.addEventListener("click", (ev) => {
    const th = ev.target.closest("thead th[data-col]");
    if (th) {
      const col = th.dataset.col;
      const ascending = model.get("sort_by") === col ? !model.get("ascending") : false;
      sortRows(col, ascending);
      model.set("sort_by", col);
      model.set("ascending", ascending);
      model.save_changes();
      return;
    }
    const toggle = ev.target.closest(".smz-toggle");
    if (toggle) {
      const group = toggle.dataset.group;
      showGroup(group);
      model.set("shown", [...new Set([...(model.get("shown") || []), group])]);
      model.save_changes();
    }
  });
  root.addEventListener("change", (ev) => {
    if (!ev.target.classList.contains("smz-scatter-pick")) return;
    const col = ev.target.value;
    for (const box of root.querySelectorAll(".smz-scatter")) box.style.display = box.dataset.col === col ? "" : "none";
    model.set("scatter", col);
    model.save_changes();
  });
  model.on("change:drawing", show);
  show();
  return () => model.off("change:drawing", show);
}

export default { render };
