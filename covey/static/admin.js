"use strict";
// Live updates for /administration: the event stream says an agent's status changed, and
// the page re-reads the fleet and the agents through the API (same session cookie).
(function () {
  window.coveyPageLoadedAt = Date.now();  // a reload would reset it; the tests check
  let pending = null;

  async function refresh() {
    pending = null;
    const [fleetReply, agentsReply] = await Promise.all([
      fetch("/api/v1/fleet", {credentials: "same-origin"}),
      fetch("/api/v1/agents", {credentials: "same-origin"})]);
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
        const row = document.querySelector('tr[data-agent-id="' + a.id + '"]');
        if (row) {
          row.querySelector(".status").textContent = a.status;
          row.querySelector(".origin").textContent = a.kill_origin || "";
          row.querySelector(".session code").textContent = a.running_session_id || "";
        }
      }
    }
  }

  function soon() { if (pending === null) { pending = setTimeout(refresh, 100); } }

  document.querySelectorAll("form[data-live]").forEach((form) => {
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const message = document.getElementById("message");
      message.textContent = "Sending…";
      const reply = await fetch(form.action, {
        method: "POST", credentials: "same-origin",
        headers: {"Accept": "application/json"},
        body: new URLSearchParams(new FormData(form))});
      const body = await reply.json().catch(() => ({}));
      message.textContent = reply.ok ? "Done." : (body.error || "Refused") + ": " + (body.hint || "");
      soon();
    });
  });

  const stream = new EventSource("/api/v1/events");
  stream.onopen = () => { document.body.dataset.live = "on"; };
  stream.addEventListener("status", (ev) => {
    const e = JSON.parse(ev.data);
    const row = document.querySelector('tr[data-agent-id="' + e.agent_id + '"]');
    if (row) { row.querySelector(".status").textContent = e.status; }
    soon();
  });
})();
