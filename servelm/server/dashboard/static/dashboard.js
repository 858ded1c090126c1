// servelm dashboard: draws the feed of /dashboard/feed (server-sent events, one JSON object
// each). Plain DOM and SVG, no library and no build step. A server's payload:
//   {kind: "server", model, time, engine: {cell_used, cell_shared, cell_cached, cell_owner,
//    requests, steps, ...}, latency, throughput, prefix_cache, window_seconds, preemptions_total}
// a router's: {kind: "router", policy, replicas: [{url, state, ..., feed: <server payload>}],
//    decisions, recent}
(() => {
  "use strict";
  const main = document.getElementById("main");
  const tooltip = document.getElementById("tooltip");
  const statusEl = document.getElementById("status");
  const titleEl = document.getElementById("title");

  const el = (tag, cls, html) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (html !== undefined) e.innerHTML = html;
    return e;
  };
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  // FNV-1a, then murmur3's finaliser: ids that differ in a few characters get far-apart hues.
  const hue = (id) => {
    let h = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 0x01000193);
    h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b); h ^= h >>> 13; h = Math.imul(h, 0xc2b2ae35); h ^= h >>> 16;
    return (h >>> 0) % 360;
  };
  const colour = (id, alpha = 1) => `hsl(${hue(id)} 62% 50% / ${alpha})`;
  const int = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
  const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? (1000 * s).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s");

  // ---- one server: KV map, queue, steps, latency --------------------------------------------
  class ServerView {
    constructor(parent) {
      this.root = el("section", "server");
      this.root.innerHTML = `
        <div class="panel kv"><h2>KV cache</h2>
          <div class="counters">
            <div class="counter">blocks in use <b class="blocks-in-use">–</b></div>
            <div class="counter"><b class="blocks-shared">–</b><span>shared</span></div>
            <div class="counter"><b class="blocks-cached">–</b><span>cached, free</span></div>
            <div class="counter"><b class="blocks-never">–</b><span>never used</span></div>
            <div class="counter">prefix-cache hit rate <b class="hit-rate">–</b></div>
          </div>
          <div class="kv-map"></div>
          <div class="scale kv-scale"></div>
          <div class="legend">
            <span><i class="cell swatch-used"></i>in use (colour: request)</span>
            <span><i class="cell swatch-used" data-shared="1"></i>shared by requests (prefix hit)</span>
            <span><i class="cell" data-state="cached"></i>free, prefix still cached</span>
            <span><i class="cell" data-state="free"></i>free</span>
            <span><i class="cell" data-state="never"></i>never used</span>
          </div>
        </div>
        <div class="panel queue"><h2>Queue</h2>
          <div class="counters">
            <div class="counter"><b class="num-running">–</b><span>running</span></div>
            <div class="counter"><b class="num-waiting">–</b><span>waiting</span></div>
            <div class="counter"><b class="preemptions">–</b><span>preemptions</span></div>
          </div>
          <div class="queue-wrap"><table>
            <thead><tr><th>request</th><th>state</th><th>age</th><th>prompt</th><th>output</th>
              <th>prefill</th><th>cached</th><th>blocks</th><th>preempt.</th></tr></thead>
            <tbody class="queue-rows"></tbody></table></div>
          <div class="more"></div>
        </div>
        <div class="panel latency"><h2>Latency and throughput</h2>
          <div class="big"><div><b class="tps-in">–</b><span>prompt tokens/s in</span></div>
            <div><b class="tps-out">–</b><span>tokens/s out</span></div></div>
          <table><thead><tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>requests / gaps</th></tr></thead>
            <tbody class="latency-rows"></tbody></table>
          <div class="scale latency-caption"></div>
          <svg class="rate-chart" height="70"></svg>
        </div>
        <div class="panel steps" style="grid-column: 1 / -1"><h2>Steps: prompt vs decode tokens, step time</h2>
          <svg class="steps-chart" height="150"></svg>
          <div class="scale steps-caption"></div>
        </div>`;
      parent.appendChild(this.root);
      this.$ = (sel) => this.root.querySelector(sel);
      this.map = this.$(".kv-map");
      this.cells = [];
      this.engine = null;
      this.map.addEventListener("mousemove", (ev) => this.hover(ev));
      this.map.addEventListener("mouseleave", () => { tooltip.hidden = true; });
    }

    update(p) {
      if (!p) return;
      const e = p.engine;
      if (e) { this.engine = e; this.updateKV(e, p); this.updateQueue(e, p); this.updateSteps(e); }
      this.updateLatency(p);
    }

    updateKV(e, p) {
      const n = e.cell_used.length, bpc = e.blocks_per_cell;
      if (this.cells.length !== n) {
        this.map.textContent = "";
        this.cells = [];
        const frag = document.createDocumentFragment();
        for (let i = 0; i < n; i++) {
          const c = el("div", "cell");
          c.dataset.i = i; c.dataset.state = "never"; c.dataset.shared = "0";
          frag.appendChild(c); this.cells.push(c);
        }
        this.map.appendChild(frag);
      }
      for (let i = 0; i < n; i++) {
        const used = e.cell_used[i], shared = e.cell_shared[i] > 0 ? "1" : "0";
        const state = used > 0 ? "used" : e.cell_cached[i] > 0 ? "cached"
          : i * bpc >= e.first_never_used ? "never" : "free";
        const r = used > 0 ? e.requests[e.cell_owner[i]] : null;
        const owner = r ? r.request_id : "";
        const size = Math.min(bpc, e.num_blocks - i * bpc);
        const bg = used > 0 ? colour(owner || "?", bpc > 1 ? 0.35 + 0.65 * used / size : 1) : "";
        const c = this.cells[i];
        if (c.dataset.state !== state) c.dataset.state = state;
        if (c.dataset.shared !== shared) c.dataset.shared = shared;
        if (c.dataset.owner !== owner) c.dataset.owner = owner;
        if (c._bg !== bg) { c.style.backgroundColor = bg; c._bg = bg; }
      }
      const inUse = this.$(".blocks-in-use");
      inUse.textContent = `${int(e.blocks_in_use)} / ${int(e.num_blocks)}`;
      inUse.dataset.used = e.blocks_in_use; inUse.dataset.total = e.num_blocks;
      this.$(".blocks-shared").textContent = int(e.blocks_shared);
      this.$(".blocks-cached").textContent = int(e.blocks_cached);
      this.$(".blocks-never").textContent = int(e.num_blocks - e.first_never_used);
      const pc = p.prefix_cache || {};
      const hit = pc.hit_rate !== null && pc.hit_rate !== undefined ? pc.hit_rate : pc.hit_rate_total;
      this.$(".hit-rate").textContent = pct(hit);
      this.$(".kv-scale").textContent = bpc === 1
        ? `one cell = one block of ${e.block_size} tokens; ${int(e.num_blocks)} blocks`
        : `one cell = ${bpc} blocks of ${e.block_size} tokens (${int(e.num_blocks)} blocks in ${n} cells; shade: share of the cell in use)`;
    }

    hover(ev) {
      const c = ev.target.closest(".cell");
      const e = this.engine;
      if (!c || !e) { tooltip.hidden = true; return; }
      const i = +c.dataset.i, bpc = e.blocks_per_cell;
      const first = i * bpc, last = Math.min(e.num_blocks, first + bpc) - 1;
      const lines = [bpc === 1 ? `block ${first}` : `blocks ${first}–${last} (${last - first + 1})`];
      const used = e.cell_used[i], shared = e.cell_shared[i], cached = e.cell_cached[i];
      if (used > 0) {
        const r = e.requests[e.cell_owner[i]];
        if (bpc > 1) lines.push(`${used} in use, ${shared} shared, ${cached} cached`);
        else if (shared) lines.push("shared by several requests (prefix-cache hit)");
        if (r) {
          lines.push(`request ${r.request_id} (${r.state})`);
          lines.push(`${int(r.prompt_tokens + r.output_tokens)} tokens: ${int(r.prompt_tokens)} prompt + ${int(r.output_tokens)} output`);
          lines.push(`${int(r.num_blocks)} blocks` + (r.cached_tokens > 0 ? `, ${int(r.cached_tokens)} prompt tokens from the cache` : ""));
        }
      } else if (cached > 0) {
        lines.push(bpc > 1 ? `${cached} free with a cached prefix` : "free; its prefix is still cached (a new request can reuse it)");
      } else {
        lines.push(first >= e.first_never_used ? "never used" : "free");
      }
      tooltip.textContent = lines.join("\n");
      tooltip.hidden = false;
      tooltip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 350) + "px";
      tooltip.style.top = ev.clientY + 14 + "px";
    }

    updateQueue(e, p) {
      this.$(".num-running").textContent = int(e.num_running);
      this.$(".num-waiting").textContent = int(e.num_waiting);
      this.$(".preemptions").textContent = int(p.preemptions_total);
      const rows = e.requests.map((r) => {
        const total = r.prompt_tokens;
        let prefill = "–";
        if (r.state === "running") {
          const done = Math.min(r.computed_tokens, total);
          prefill = done >= total ? "done"
            : `<span class="progress"><i style="width:${(100 * done / total).toFixed(0)}%"></i></span>${int(done)}/${int(total)}`;
        }
        return `<tr data-state="${r.state}" data-request-id="${esc(r.request_id)}">
          <td class="id" title="${esc(r.request_id)}"><span class="dot" style="background:${colour(r.request_id)}"></span>${esc(r.request_id)}</td>
          <td class="state">${r.state}</td><td>${r.age.toFixed(1)} s</td><td>${int(r.prompt_tokens)}</td>
          <td>${int(r.output_tokens)}</td><td>${prefill}</td><td>${r.cached_tokens >= 0 ? int(r.cached_tokens) : "–"}</td>
          <td>${int(r.num_blocks)}</td><td>${r.preemptions || ""}</td></tr>`;
      });
      this.$(".queue-rows").innerHTML = rows.join("") ||
        `<tr><td class="empty" colspan="9">no requests</td></tr>`;
      const listed = e.requests.length - e.num_running;
      this.$(".more").textContent = e.num_waiting > listed ? `+ ${int(e.num_waiting - listed)} more waiting` : "";
    }

    updateSteps(e) {
      const steps = (e.steps || []).slice(-200);
      const svg = this.$(".steps-chart");
      if (!steps.length) { svg.innerHTML = `<text x="10" y="20">no steps yet</text>`; this.$(".steps-caption").textContent = ""; return; }
      const W = svg.clientWidth || 800, H = 150, top = 14, h = H - top - 4;
      svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
      const maxTok = Math.max(1, ...steps.map((s) => s[1] + s[2]));
      const maxSec = Math.max(1e-6, ...steps.map((s) => s[3]));
      const bw = W / Math.max(steps.length, 80);
      let bars = "", line = "";
      steps.forEach((s, k) => {
        const x = k * bw, hd = h * s[2] / maxTok, hp = h * s[1] / maxTok;
        bars += `<rect x="${x.toFixed(1)}" y="${(H - 4 - hd).toFixed(1)}" width="${Math.max(bw - 1, 0.5).toFixed(1)}" height="${hd.toFixed(1)}" fill="var(--decode)"/>`;
        if (hp > 0) bars += `<rect x="${x.toFixed(1)}" y="${(H - 4 - hd - hp).toFixed(1)}" width="${Math.max(bw - 1, 0.5).toFixed(1)}" height="${hp.toFixed(1)}" fill="var(--prompt)"/>`;
        line += `${(x + bw / 2).toFixed(1)},${(H - 4 - h * s[3] / maxSec).toFixed(1)} `;
      });
      svg.innerHTML = bars + `<polyline points="${line}" fill="none" stroke="#1d232a" stroke-width="1.2"/>` +
        `<text x="4" y="10">${int(maxTok)} tokens</text><text x="${W - 4}" y="10" text-anchor="end">step time, max ${secs(maxSec)}</text>`;
      const n = steps.length, sum = (j) => steps.reduce((a, s) => a + s[j], 0);
      this.$(".steps-caption").innerHTML =
        `last ${n} steps: <b style="color:var(--prompt)">${int(sum(1) / n)}</b> prompt + <b style="color:var(--decode)">${int(sum(2) / n)}</b> decode tokens per step, mean step ${secs(sum(3) / n)} (line)`;
    }

    updateLatency(p) {
      const lat = p.latency || {}, tp = p.throughput || {};
      this.$(".tps-in").textContent = int(tp.in);
      this.$(".tps-out").textContent = int(tp.out);
      const names = { ttft: "TTFT", tpot: "TPOT", itl: "ITL", e2e: "end to end" };
      this.$(".latency-rows").innerHTML = Object.entries(names).map(([k, label]) => {
        const l = lat[k] || {};
        return `<tr data-metric="${k}"><td>${label}</td><td>${secs(l.p50)}</td><td>${secs(l.p90)}</td><td>${secs(l.p99)}</td><td>${int(l.count)}</td></tr>`;
      }).join("");
      this.$(".latency-caption").textContent = p.latency === undefined ? ""
        : `percentiles over the last ${Math.round(p.window_seconds)} s` +
          " (the server's histograms, as in /metrics); tokens/s over 10 s";
      const hist = tp.history || [];
      const svg = this.$(".rate-chart");
      if (hist.length > 1) {
        const W = svg.clientWidth || 400, H = 70, t0 = hist[0][0], span = Math.max(1, hist[hist.length - 1][0] - t0);
        svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
        const max = Math.max(1, ...hist.map((r) => Math.max(r[1], r[2])));
        const pts = (j) => hist.map((r) => `${((r[0] - t0) / span * W).toFixed(1)},${(H - 2 - (H - 14) * r[j] / max).toFixed(1)}`).join(" ");
        svg.innerHTML = `<polyline points="${pts(1)}" fill="none" stroke="var(--prompt)" stroke-width="1.5"/>` +
          `<polyline points="${pts(2)}" fill="none" stroke="var(--decode)" stroke-width="1.5"/>` +
          `<text x="2" y="10">tokens/s in (orange), out (blue); max ${int(max)}</text>`;
      }
    }
  }

  // ---- a router: its replicas, policy decisions, and one ServerView per replica -------------
  class RouterView {
    constructor(parent) {
      this.root = el("section", "router");
      this.root.innerHTML = `
        <div class="router-grid">
          <div class="panel"><h2>Router: replicas</h2><table>
            <thead><tr><th>replica</th><th>state</th><th>in flight</th><th>waiting</th><th>running</th><th>KV use</th><th>load</th></tr></thead>
            <tbody class="replica-rows"></tbody></table></div>
          <div class="panel"><h2>Policy <span class="policy"></span>: decisions</h2>
            <table><thead><tr><th>reason</th><th>count</th></tr></thead><tbody class="decision-rows"></tbody></table>
            <div class="queue-wrap" style="max-height:160px"><table><thead><tr><th>recent</th><th>replica</th><th>reason</th></tr></thead>
              <tbody class="recent-rows"></tbody></table></div></div>
        </div>
        <div class="replicas"></div>`;
      parent.appendChild(this.root);
      this.$ = (sel) => this.root.querySelector(sel);
      this.views = new Map();
    }

    update(p) {
      this.$(".policy").textContent = p.policy;
      this.$(".replica-rows").innerHTML = p.replicas.map((r) => `<tr data-replica="${esc(r.url)}">
        <td>${esc(r.url)}</td><td>${r.state}${r.draining ? " (draining)" : ""}</td><td>${int(r.in_flight)}</td>
        <td>${int(r.waiting)}</td><td>${int(r.running)}</td><td>${pct(r.kv_usage)}</td><td>${(r.load ?? 0).toFixed(1)}</td></tr>`).join("");
      this.$(".decision-rows").innerHTML = Object.entries(p.decisions || {}).map(([k, v]) =>
        `<tr data-reason="${esc(k)}"><td>${esc(k)}</td><td>${int(v)}</td></tr>`).join("") ||
        `<tr><td class="empty" colspan="2">no requests routed yet</td></tr>`;
      this.$(".recent-rows").innerHTML = (p.recent || []).slice().reverse().map((d) =>
        `<tr><td>${new Date(d.time * 1000).toLocaleTimeString()}</td><td>${esc(d.replica)}</td><td>${esc(d.reason)}</td></tr>`).join("");
      const seen = new Set();
      for (const r of p.replicas) {
        seen.add(r.url);
        let v = this.views.get(r.url);
        if (!v) {
          const box = el("div", "panel replica");
          box.dataset.replica = r.url;
          box.appendChild(el("h2", "", `Replica <span class="replica-url">${esc(r.url)}</span> <span class="feed-state"></span>`));
          this.$(".replicas").appendChild(box);
          v = new ServerView(box);
          v.box = box;
          this.views.set(r.url, v);
        }
        v.box.querySelector(".feed-state").textContent = r.feed ? "" : `(no feed${r.feed_error ? ": " + r.feed_error : ""})`;
        if (r.feed) v.update(r.feed);
      }
      for (const [url, v] of this.views) if (!seen.has(url)) { v.box.remove(); this.views.delete(url); }
    }
  }

  // ---- the feed -------------------------------------------------------------------------------
  const view = document.body.dataset.kind === "router" ? new RouterView(main) : new ServerView(main);
  let updates = 0;
  const follow = () => {
    const source = new EventSource("dashboard/feed");
    source.onopen = () => { statusEl.textContent = "live"; statusEl.dataset.connected = "1"; };
    // A stream ends every few seconds and the browser reconnects at once: only a connection
    // still down after two seconds counts as lost. An answer other than 200 (an ingress's 502
    // while a pod restarts) closes an EventSource for good: then a new one, every two seconds.
    source.onerror = () => setTimeout(() => {
      if (source.readyState === EventSource.OPEN) return;
      statusEl.textContent = "disconnected, retrying…"; statusEl.dataset.connected = "0";
      if (source.readyState === EventSource.CLOSED) follow();
    }, 2000);
    source.onmessage = (msg) => {
      const p = JSON.parse(msg.data);
      view.update(p);
      updates += 1;
      document.body.dataset.updates = updates;
      titleEl.textContent = p.kind === "router" ? `router, ${p.replicas.length} replicas` : p.model;
    };
  };
  follow();
})();
