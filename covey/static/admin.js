"use strict";
// Live updates for /administration: the event stream says an agent's status changed, and
// the page re-reads the fleet, the agents and what needs a look through the API (same
// session cookie). A poll beside the stream brings what no status event announces: an
// agent created after the page loaded, its spend, a task that failed.
(function () {
  window.coveyPageLoadedAt = Date.now();  // a reload would reset it; the tests check
  const POLL_MS = 3000;
  let pending = null;
  const money = (x) => "$" + Number(x || 0).toFixed(4);

  function fillAgent(row, a) {
    row.dataset.killed = String(a.killed);
    row.querySelector(".status").textContent = a.status;
    row.querySelector(".origin").textContent = a.kill_origin || "";
    row.querySelector(".session code").textContent = a.running_session_id || "";
    row.querySelector(".spent").textContent = money(a.spent_usd);
    row.querySelector(".budget").textContent = money(a.budget_usd);
    row.querySelector(".remaining").textContent = money(a.remaining_usd);
    // The buttons follow the agent's state: Kill while it may run, Resume once killed.
    const stop = row.querySelector("[data-agent-alive]");
    if (stop) {
      stop.hidden = a.killed;
      if (a.killed) { stop.open = false; }  // never while someone types why: not killed yet
    }
    const resume = row.querySelector("[data-agent-killed]");
    if (resume) { resume.hidden = !a.killed; }
  }

  function addAgent(a) {
    const row = document.getElementById("agent-row").content.querySelector("tr").cloneNode(true);
    row.dataset.agentId = a.id;
    row.querySelector(".display-name").textContent = a.display_name;
    row.querySelectorAll(".slug").forEach((el) => { el.textContent = a.slug; });
    row.querySelectorAll("form").forEach((form) => {
      form.setAttribute("action", form.getAttribute("action")
        .replace("/agents//", "/agents/" + encodeURIComponent(a.id) + "/"));
      live(form);
    });
    fillAgent(row, a);
    document.querySelector("#agents tbody").appendChild(row);
  }

  function fillList(id, items, text, key) {
    const list = document.getElementById(id);
    const rows = items.map((item) => {
      const li = document.createElement("li");
      li.textContent = text(item);
      li.dataset[key] = item[key === "taskId" ? "task_id" : "session_id"];
      return li;
    });
    if (!rows.length) {
      const none = document.createElement("li");
      none.className = "none";
      none.textContent = "none";
      rows.push(none);
    }
    list.replaceChildren(...rows);
  }

  async function refresh() {
    pending = null;
    const [fleetReply, agentsReply, attentionReply] = await Promise.all([
      fetch("/api/v1/fleet", {credentials: "same-origin"}),
      fetch("/api/v1/agents", {credentials: "same-origin"}),
      fetch("/administration/attention", {credentials: "same-origin"})]);
    if (fleetReply.ok) {
      const f = await fleetReply.json();
      const box = document.getElementById("fleet-state");
      box.dataset.killed = String(f.fleet_killed);
      box.className = "banner " + (f.fleet_killed ? "killed" : "running");
      box.querySelector(".headline").textContent = f.fleet_killed
        ? "EMERGENCY STOP: every agent of this organisation is paused" : "Fleet running";
      box.querySelector(".who").textContent = f.fleet_killed
        ? "pulled by " + (f.fleet_killed_by || "?") + " at " + f.fleet_killed_at
          + (f.fleet_killed_reason ? " — " + f.fleet_killed_reason : "") : "";
      document.querySelectorAll("[data-when-killed]").forEach(
        (el) => { el.hidden = !f.fleet_killed; });
      document.querySelectorAll("[data-when-running]").forEach(
        (el) => {
          el.hidden = f.fleet_killed;
          // Fold the confirmation away once the fleet is stopped, and never while someone
          // is typing why: every agent's status change brings a refresh.
          if (f.fleet_killed) { el.open = false; }
        });
    }
    if (agentsReply.ok) {
      for (const a of await agentsReply.json()) {
        const row = document.querySelector('#agents tbody tr[data-agent-id="' + a.id + '"]');
        if (row) { fillAgent(row, a); } else { addAgent(a); }
      }
    }
    if (attentionReply.ok) {
      const a = await attentionReply.json();
      fillList("failed-tasks", a.failed_tasks,
               (t) => t.agent + ": " + t.title + " — " + t.state + ": " + t.reason + " " + t.at,
               "taskId");
      fillList("guard-trips", a.guard_trips,
               (r) => r.agent + " stopped by its " + r.layer + " guard: " + r.reason + " " + r.at,
               "sessionId");
    }
  }

  function soon() { if (pending === null) { pending = setTimeout(refresh, 100); } }

  // After a stop, what it did: not only "Done." (the kill's own answer, as the API gives it).
  function showStop(s) {
    const n = (xs) => (xs || []).length;
    const box = document.getElementById("stop-summary");
    const counts = box.querySelector(".counts");
    counts.replaceChildren();
    for (const [key, label] of [["agents_stopped", "agent(s) stopped"],
                                ["sessions_cancelled", "session(s) cancelled"],
                                ["tasks_requeued", "task(s) back in the backlog"],
                                ["sessions_acknowledged", "daemon(s) acknowledged the kill"]]) {
      const part = document.createElement("span");
      part.dataset.count = key;
      part.textContent = n(s[key]) + " " + label;
      if (counts.childNodes.length) { counts.append(" · "); }
      counts.append(part);
    }
    if (s.already_killed) { counts.append(" (it was stopped already)"); }
    box.querySelector(".daemons").replaceChildren(...(s.daemons || []).map((d) => {
      const li = document.createElement("li");
      li.dataset.sessionId = d.session_id;
      li.textContent = (d.agent || d.session_id) + ": its daemon " + d.answer;
      return li;
    }));
    box.hidden = false;
  }

  function live(form) {
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const message = document.getElementById("message");
      message.textContent = "Sending…";
      message.dataset.outcome = "";  // "ok" or "refused" once answered: what scripts wait on
      const reply = await fetch(form.action, {
        method: "POST", credentials: "same-origin",
        headers: {"Accept": "application/json"},
        body: new URLSearchParams(new FormData(form))});
      const body = await reply.json().catch(() => ({}));
      message.dataset.outcome = reply.ok ? "ok" : "refused";
      if (!reply.ok) {
        message.textContent = (body.error || "Refused") + ": " + (body.hint || "");
      } else if (form.hasAttribute("data-stop")) {
        message.textContent = "Stopped.";
        showStop(body);
        form.reset();
      } else {
        message.textContent = body.agents_woken !== undefined
          ? "Fleet resumed: " + body.agents_woken + " agent(s) woken." : "Resumed.";
      }
      soon();
    });
  }

  document.querySelectorAll("form[data-live]").forEach(live);
  setInterval(soon, POLL_MS);

  const stream = new EventSource("/api/v1/events");
  stream.onopen = () => { document.body.dataset.live = "on"; };
  stream.addEventListener("status", (ev) => {
    const e = JSON.parse(ev.data);
    const row = document.querySelector('#agents tbody tr[data-agent-id="' + e.agent_id + '"]');
    if (row) { row.querySelector(".status").textContent = e.status; }
    soon();
  });
})();
